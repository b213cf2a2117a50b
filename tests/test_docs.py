"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process.

A block is run as a script (`__main__`) from an empty folder, with this checkout's `engine` first on the
path; it must exit 0 and leave, among its globals, something engine made (a quantized tensor, a model with
engine modules or quantize_'s weights), so a block that stopped doing its job fails too. A block for several
processes starts with the marker line

    # run with: torchrun <torchrun options> <name>.py

and runs under `python -m torch.distributed.run <torchrun options>` (2 local processes at most: keep it fast).
Python code goes in ```python fences only: a ```py or ```python3 fence (never run, so never checked) fails.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
PYTHON_TAGS = ("python", "py", "python3", "pycon", "ipython")
TORCHRUN = re.compile(r"# run with: torchrun (?P<options>.*?) ?(?P<script>[\w.-]+\.py)")
MAX_PROCESSES = 2
TIMEOUT_S = 240  # per block; all of them together take about a minute on 2 cores

#: run by the subprocess: the block as __main__, then a line saying whether it left engine objects behind
DRIVER = """
import runpy, sys
found = runpy.run_path(sys.argv[1], run_name="__main__")
import torch
from engine.inference import QuantizedWeight
from engine.modules import FP8Module
from engine.tensors import QuantizedTensor

def made_by_engine(value):
    if isinstance(value, (QuantizedTensor, QuantizedWeight)):
        return True
    return isinstance(value, torch.nn.Module) and (
        any(isinstance(m, FP8Module) for m in value.modules())
        or any(isinstance(p, (QuantizedWeight, QuantizedTensor)) for p in value.parameters()))

# one write of the whole line: the ranks of a torchrun block share stdout, and print() writes its parts apart
sys.stdout.write(f"docs-check: engine objects: {any(made_by_engine(v) for v in list(found.values()))}\\n")
sys.stdout.flush()
"""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    tag: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def torchrun(self) -> tuple[list[str], str] | None:
        """(torchrun options, script name) from the marker on the block's first line, or None."""
        first = self.code.split("\n", 1)[0]
        if not first.startswith("# run with:"):
            return None
        match = TORCHRUN.fullmatch(first.strip())
        if match is None:
            raise ValueError(f"{self.name}: expected '# run with: torchrun <options> <name>.py', got {first!r}")
        return shlex.split(match["options"]), match["script"]


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            found.append(Block(doc, text.count("\n", 0, match.start()) + 1, match[1].strip(), match[2]))
    return found


PYTHON_BLOCKS = [b for b in blocks() if b.tag == "python"]


def test_python_code_is_in_python_fences():
    others = [f"{b.name} (```{b.tag})" for b in blocks() if b.tag.lower() in PYTHON_TAGS and b.tag != "python"]
    assert not others, f"use ```python so the block is run: {others}"
    assert len(PYTHON_BLOCKS) >= 10
    assert sum(b.torchrun() is not None for b in PYTHON_BLOCKS) >= 1  # the tensor-parallel example


def command(block: Block, folder: Path) -> list[str]:
    driver = folder / "docs_driver.py"
    driver.write_text(DRIVER)
    spec = block.torchrun()
    script = folder / (spec[1] if spec else "block.py")
    script.write_text(block.code)
    if spec is None:
        return [sys.executable, str(driver), str(script)]
    options = spec[0]
    nproc = options[options.index("--nproc-per-node") + 1] if "--nproc-per-node" in options else None
    assert nproc is not None and nproc.isdigit() and int(nproc) <= MAX_PROCESSES, \
        f"{block.name}: give --nproc-per-node N with N <= {MAX_PROCESSES}, got {options}"
    return [sys.executable, "-m", "torch.distributed.run", *options, str(driver), str(script)]


def run_block(block: Block, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command(block, folder), cwd=folder, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name}: still running after {TIMEOUT_S} s")


def died_at_teardown(done: subprocess.CompletedProcess) -> bool:
    """A torchrun block that one process aborted at gloo's teardown, in `dist.destroy_process_group()` or at
    interpreter exit.

    torch's race, not the block's: a ProcessGroupGloo worker thread that drops the last reference to a
    finished collective needs the GIL to free the Python state it captured; when the main thread is
    already tearing the group down or in Py_FinalizeEx, the worker exits and std::terminate aborts the process
    ("terminate called without an active exception"; a core dump shows ~AsyncAllreduceWork in
    ProcessGroupGloo::runLoop). It needs the worker thread to be descheduled right after the collective, so it
    shows up rarely, on loaded machines more (pytorch/pytorch#179291 tried an atexit destroy and was abandoned).
    A block's own error ends with its Python traceback and no such abort; a block that aborts this way every
    time still fails, on its second run.
    """
    return done.returncode != 0 and "terminate called without an active exception" in done.stderr


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_block_runs_as_written(block, tmp_path):
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # this checkout's engine, wherever the block runs
    done = run_block(block, tmp_path, env)
    if block.torchrun() is not None and died_at_teardown(done):
        done = run_block(block, tmp_path, env)  # torch's gloo teardown race (see died_at_teardown): once more
    if done.returncode != 0:
        pytest.fail(f"{block.name} failed (exit {done.returncode}):\n{done.stderr[-12000:]}")
    assert "docs-check: engine objects: True" in done.stdout, \
        f"{block.name} ran but left nothing engine made among its globals:\n{done.stdout[-2000:]}"


def test_only_a_teardown_abort_is_run_again():
    abort = "terminate called without an active exception\nChildFailedError"
    finished = "docs-check: engine objects: True\n" * MAX_PROCESSES
    assert died_at_teardown(subprocess.CompletedProcess([], 1, finished, abort))
    assert died_at_teardown(subprocess.CompletedProcess([], 1, "", abort))  # aborted in destroy_process_group
    assert not died_at_teardown(subprocess.CompletedProcess([], 0, finished, ""))
    assert not died_at_teardown(subprocess.CompletedProcess([], 1, finished, "AssertionError"))
    assert not died_at_teardown(subprocess.CompletedProcess([], 1, "", "Traceback ...\nValueError: x"))
