"""engine.memory: malloc reuses freed memory once engine is imported; opt-out; no aliasing of live outputs.

The allocator's behaviour is observed through glibc itself (mallinfo2: bytes in mmapped
blocks) and the kernel's page-fault counter, in fresh subprocesses (the settings are
process-wide and applied once). Nothing here is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import engine
from conftest import FIELDS, assert_buffers_equal, make_input, make_quantizer, reference_buffers, storage_of
from engine import memory
from engine.autocast import fp8_autocast
from engine.recipes import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

ROOT = Path(__file__).resolve().parents[1]
ON_GLIBC = memory._glibc() is not None

# Runs in a fresh process: imports engine (which applies the settings), then allocates
# 48 MiB tensors and reports what glibc and the kernel saw.
PROBE = r"""
import ctypes, json, resource
import torch
import engine
from engine import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                             "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
n = 48 << 20

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

mapped_before = libc.mallinfo2().hblkhd
t = torch.empty(n, dtype=torch.uint8).fill_(1)
mapped_while_alive = libc.mallinfo2().hblkhd - mapped_before
del t
for _ in range(8):  # glibc's aligned allocation reuses a freed block once its neighbours have merged into it
    torch.empty(n, dtype=torch.uint8).fill_(2)
start = faults()
for _ in range(3):  # the same size again, in the steady state: reused pages or fresh ones?
    torch.empty(n, dtype=torch.uint8).fill_(3)
refaults = faults() - start
rss_kept = rss()
released = memory.release_free_memory()
print(json.dumps({"status": memory.status(), "mapped_while_alive": mapped_while_alive,
                  "refaults": refaults, "rss_drop": rss_kept - rss(), "released": released, "n": n}))
"""


def probe(tuning: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != memory.ENV_VAR}
    if tuning is not None:
        env[memory.ENV_VAR] = tuning
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not ON_GLIBC, reason="the settings are for glibc's malloc")
def test_importing_engine_with_the_opt_in_makes_large_blocks_reuse_freed_memory():
    got = probe("1")
    assert got["status"].startswith("applied"), got
    assert got["mapped_while_alive"] == 0, got  # served from the heap, not by its own mmap
    # 3 x 48 MiB allocated and written again: without reuse that is 3 x 12288 faults of 4 KiB
    # pages (or 3 x 24 of 2 MiB huge pages); with reuse, none beyond noise.
    assert got["refaults"] < 24, got
    # what is free stays resident until released, and release_free_memory() gives it back
    assert got["released"] and got["rss_drop"] >= got["n"] // 2, got


@pytest.mark.skipif(not ON_GLIBC, reason="the settings are for glibc's malloc")
@pytest.mark.parametrize("tuning", [None, "0"])
def test_by_default_malloc_is_left_as_it_was(tuning):
    got = probe(tuning)
    assert got["status"].startswith("off (opt in")
    assert got["mapped_while_alive"] >= got["n"], got  # glibc's default: a block this large is mmapped
    assert got["refaults"] >= 3 * got["n"] // (2 << 20), got  # and unmapped on free: fresh pages every time


def test_status_says_why_when_not_applied(monkeypatch):
    monkeypatch.setenv(memory.ENV_VAR, "0")
    assert memory._apply().startswith("off (opt in")  # _apply only decides; tune_malloc applies once
    assert memory._apply(False) == "off (tune_malloc(False))"
    monkeypatch.setenv(memory.ENV_VAR, "1")
    monkeypatch.setattr(memory, "_glibc", lambda: None)
    assert memory._apply() == "off (the C library is not glibc)"


# ------------------------------------------------------------------------------------------ no aliasing
@pytest.fixture(params=["malloc", "reused_outputs"])
def outputs(request, monkeypatch):
    """Quantize outputs from malloc (small ones, the default below 4 MiB), or every one from
    `memory.output_buffer` (its size threshold lowered to 0), so the tests below cover both."""
    if request.param == "reused_outputs":
        monkeypatch.setattr(memory, "REUSED_OUTPUT_MIN_BYTES", 0)
    memory.release_free_memory()
    yield request.param
    memory.release_free_memory()


@pytest.mark.parametrize("kind", ["delayed_e4m3", "current_e4m3", "block1d", "block2d", "mx_rceil"])
def test_live_outputs_keep_their_values_while_later_quantizations_reuse_freed_memory(kind, outputs):
    q = make_quantizer(kind)
    shape = (256, 1024)  # 256 KiB FP8 buffers: above glibc's default mmap threshold
    kept = {}
    for i in range(8):
        out = q(make_input(shape, seed=i))
        if i % 2 == 0:  # keep every other result alive (as if saved for backward); free the rest
            kept[i] = out
        del out
    spans = []
    for i, out in kept.items():
        buffers = {name: getattr(storage_of(out), name) for name in FIELDS}
        assert_buffers_equal(buffers, reference_buffers(kind, make_input(shape, seed=i)))
        spans += [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in
                  (t.untyped_storage() for t in buffers.values() if t is not None and t.numel())]
    spans = sorted(set(spans))  # per-tensor schemes hold one scale tensor for both usages
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "live buffers overlap"


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=["current", "block", "mxfp8"])
def test_two_steps_alive_at_once_give_the_gradients_of_each_step_alone(recipe, outputs):
    """Forward twice before either backward: the FP8 operands saved by the first step must survive the
    second step's allocations (which reuse whatever was freed in between). Stateless recipes only:
    under delayed scaling the order of steps changes the scales (the quantizer test covers it)."""
    torch.manual_seed(0)
    layer = engine.Linear(512, 256)
    xs = [torch.randn(256, 512, requires_grad=True) for _ in range(2)]

    def step(x):
        with fp8_autocast(recipe=recipe):
            return layer(x).square().sum()

    alone = []
    for x in xs:
        layer.zero_grad()
        step(x).backward()
        alone.append((x.grad.clone(), layer.weight.grad.clone()))
        x.grad = None
    layer.zero_grad()
    losses = [step(x) for x in xs]  # both graphs alive
    for i in (1, 0):  # backward in reverse order
        layer.zero_grad()
        losses[i].backward()
        assert torch.equal(xs[i].grad, alone[i][0]) and torch.equal(layer.weight.grad, alone[i][1])


# ------------------------------------------------------------------------------------------ reused outputs
@pytest.mark.parametrize("kind", ["current_e4m3", "block1d", "mx_rceil"])
def test_a_large_output_nobody_holds_is_reused_and_a_held_one_never(kind):
    memory.release_free_memory()
    q = make_quantizer(kind)
    x = make_input((2048, 2048), seed=0)  # 4 MiB FP8 outputs: at the threshold
    first = storage_of(q(x)).rowwise_data
    address = first.data_ptr()
    again = storage_of(q(x)).rowwise_data
    assert again.data_ptr() != address  # `first` is still held
    del first, again
    assert storage_of(q(x)).rowwise_data.data_ptr() == address  # idle: handed out again
    memory.release_free_memory()
    assert memory._OUTPUTS.buffers == {}


@pytest.mark.parametrize("holder", ["view", "storage", "tensor on the storage", "autograd", "numpy"])
def test_every_kind_of_reference_keeps_a_buffer_out_of_reuse(holder, monkeypatch):
    monkeypatch.setattr(memory, "REUSED_OUTPUT_MIN_BYTES", 0)
    memory.release_free_memory()
    shape = (64, 64)
    buffer = memory.output_buffer(shape, torch.float8_e4m3fn)
    buffer.view(torch.uint8).fill_(7)
    if holder == "view":
        kept = buffer[1:]
    elif holder == "storage":
        kept = buffer.untyped_storage()
    elif holder == "tensor on the storage":
        kept = torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage())
    elif holder == "autograd":
        x = torch.ones(2, requires_grad=True)

        class Save(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(buffer)
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g

        kept = Save.apply(x)  # the graph holds the buffer through its saved tensors
    else:
        kept = buffer.view(torch.uint8).numpy()
    address = buffer.data_ptr()
    del buffer
    for _ in range(3):
        assert memory.output_buffer(shape, torch.float8_e4m3fn).data_ptr() != address
    del kept
    assert memory.output_buffer(shape, torch.float8_e4m3fn).data_ptr() == address
    memory.release_free_memory()


def test_small_outputs_and_other_threads_do_not_share_buffers():
    assert memory.output_buffer((16, 16), torch.float8_e4m3fn) is None  # below the threshold: malloc's
    memory.release_free_memory()
    mine = memory.output_buffer((2048, 2048), torch.float8_e4m3fn)
    address = mine.data_ptr()
    del mine
    seen = []
    thread = threading.Thread(target=lambda: seen.append(memory.output_buffer((2048, 2048), torch.float8_e4m3fn)
                                                         .data_ptr()))
    thread.start()
    thread.join()
    assert seen[0] != address  # that thread has its own buffers
    assert memory.output_buffer((2048, 2048), torch.float8_e4m3fn).data_ptr() == address
    memory.release_free_memory()


@pytest.mark.parametrize("element", ["e2m1", "e2m3", "e3m2"])
def test_mx_small_outputs_reuse_idle_buffers_and_keep_held_ones(element, monkeypatch):
    from engine.quantizers import MXQuantizer

    q = MXQuantizer(element)
    xs = [make_input((64, 96), seed=i) for i in range(3)]
    fresh = [{name: getattr(storage_of(q(x)), name) for name in FIELDS} for x in xs]  # small: malloc's
    monkeypatch.setattr(memory, "REUSED_OUTPUT_MIN_BYTES", 0)
    memory.release_free_memory()
    held = [q(x) for x in xs]  # all alive at once: three sets of buffers
    for out, expected in zip(held, fresh):
        assert_buffers_equal({name: getattr(storage_of(out), name) for name in FIELDS}, expected)
    address = storage_of(held[0]).rowwise_data.data_ptr()
    del held
    assert storage_of(q(xs[0])).rowwise_data.data_ptr() == address
    memory.release_free_memory()


def test_buffers_are_kept_for_the_most_recent_shapes_only(monkeypatch):
    monkeypatch.setattr(memory, "REUSED_OUTPUT_MIN_BYTES", 0)
    memory.release_free_memory()
    for rows in range(1, memory.REUSED_OUTPUT_SHAPES + 3):  # a new shape each call, as prompts of every length
        memory.output_buffer((rows, 8), torch.uint8)
    kept = [shape for shape, _ in memory._OUTPUTS.buffers]
    assert kept == [(rows, 8) for rows in range(3, memory.REUSED_OUTPUT_SHAPES + 3)]
    memory.output_buffer((3, 8), torch.uint8)  # used again: now the most recent
    assert next(reversed(memory._OUTPUTS.buffers)) == ((3, 8), torch.uint8)
    memory.release_free_memory()
