"""Every file, link and command that README.md and docs/*.md name exists.

* Paths in backticks that start with `engine/`, `csrc/`, `tests/`, `benchmarks/` or `docs/` (from the
  repository root; a glob must match something, a `:line` suffix is dropped).
* The file tree drawn in docs/architecture.md (a fence whose first line is `engine/`): every entry
  exists, and a folder drawn with its entries lists all of them (so a deleted file or a new module
  shows up here).
* Markdown links and images to this repository's files (relative to the page): the file exists inside
  the repository, and a `#anchor` into a markdown page is one of its headings.
* `python -m engine ...`, `torchrun ... -m engine ...` and `engine <command>` in backticks and shell
  fences: parsed by engine's own CLI parser, so the command, its options and their values (recipe and
  benchmark names) are real; a benchmark's options by that benchmark's parser (nothing runs). A mention
  without a required argument (`python -m engine eval`) is parsed with a placeholder for it. torchrun's
  own options (also on the `# run with: torchrun ...` line of a python block) by torchrun's parser.
* `make <target>`: a target of the Makefile.

Python blocks themselves are run by tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
SHELL_TAGS = ("sh", "bash", "shell", "console", "")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(r"(?<![\w./~-])((?:engine|csrc|tests|benchmarks|docs)/[\w./*-]*)")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
ENGINE_CALL = re.compile(r"(?:^|\s)(?:python3? -m engine|(?P<torchrun>torchrun\b.*?)\s-m engine|^engine)"
                         r"(?=\s|$)(?P<args>.*)")
MAKE_CALL = re.compile(r"(?:^|\s)make\s+(?P<target>[\w.-]+)")


@dataclass(frozen=True)
class Code:
    """A piece of code a page names: an inline span, or one (continued) line of a shell fence."""

    where: str
    text: str


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _blank_fences(text: str) -> str:
    """The page with every fenced block's lines emptied (line numbers kept), for what lies outside them."""
    return FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)


def code_of(name: str, text: str) -> list[Code]:
    """Inline code spans outside fences (a span may wrap lines) and the lines of shell fences."""
    found = []
    prose = _blank_fences(text)
    for match in SPAN.finditer(prose):
        found.append(Code(f"{name}:{_line(prose, match.start())}", " ".join(match[2].split())))
    for match in FENCE.finditer(text):
        if match[1].strip() not in SHELL_TAGS or match[2].startswith("engine/"):
            continue  # not shell; or a file tree (tree_entries)
        first = _line(text, match.start(2))
        joined = match[2].replace("\\\n", " ")  # a shell line continued with a backslash
        for i, line in enumerate(joined.split("\n")):
            if line.strip():
                found.append(Code(f"{name}:{first + i}", " ".join(line.split())))
    return found


# ---------------------------------------------------------------------------------------------- paths

def path_problems(name: str, text: str) -> list[str]:
    problems = []
    for code in code_of(name, text):
        for path in PATH.findall(code.text):
            path = path.rstrip(".")
            if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                problems.append(f"{code.where}: `{path}` does not exist")
    return problems


@dataclass(frozen=True)
class TreeEntry:
    where: str
    path: str  # from the repository root; a folder ends in "/"


def tree_entries(name: str, text: str) -> list[TreeEntry]:
    """The entries of each file tree drawn in a fence that starts with `engine/` (two spaces per level;
    a line indented past its entry's children is that entry's description, continued)."""
    entries = []
    for match in FENCE.finditer(text):
        if match[1].strip() or not match[2].startswith("engine/"):
            continue
        first = _line(text, match.start(2))
        parents: list[tuple[int, str]] = []  # (indent, folder path) of the folders we are in
        last_indent = -2
        for i, line in enumerate(match[2].split("\n")):
            entry = re.match(r"( *)([\w.-]+/?)(?: {2,}|$)", line)
            indent = len(line) - len(line.lstrip(" "))
            if not line.strip() or entry is None or indent > last_indent + 2:
                continue  # a description's continuation line
            while parents and parents[-1][0] >= indent:
                parents.pop()
            path = (parents[-1][1] if parents else "") + entry[2]
            entries.append(TreeEntry(f"{name}:{first + i}", path))
            if path.endswith("/"):
                parents.append((indent, path))
            last_indent = indent
    return entries


def listed(folder: Path) -> set[str]:
    """What a tree should draw inside a folder: its source files and subfolders."""
    return {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix in (".py", ".cpp", ".h"))}


def tree_problems(name: str, text: str) -> list[str]:
    entries = tree_entries(name, text)
    problems = [f"{e.where}: `{e.path}` does not exist" for e in entries
                if not (ROOT / e.path).exists() or e.path.endswith("/") != (ROOT / e.path).is_dir()]
    drawn: dict[str, set[str]] = {}
    for e in entries:
        parent, _, leaf = e.path.rstrip("/").rpartition("/")
        drawn.setdefault(parent + "/" if parent else "", set()).add(leaf + ("/" if e.path.endswith("/") else ""))
    for folder, names in drawn.items():
        if folder and (ROOT / folder).is_dir():
            missing = sorted(listed(ROOT / folder) - names)
            if missing:
                problems.append(f"{name}: the tree draws the entries of `{folder}` but not {missing}")
    if entries and "engine/" not in drawn:
        problems.append(f"{name}: the tree draws no entries of `engine/`")
    return problems


# ---------------------------------------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(_blank_fences(page.read_text()))}


def link_problems(page: Path, text: str) -> list[str]:
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    problems = []
    prose = _blank_fences(text)
    for match in LINK.finditer(prose):
        target = match[1]
        where = f"{name}:{_line(prose, match.start())}"
        if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.is_relative_to(ROOT):
            problems.append(f"{where}: ({target}) points outside the repository")
        elif not path.exists():
            problems.append(f"{where}: ({target}) does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{where}: ({target}): {path.name} has no heading with the anchor #{anchor}")
    return problems


# ------------------------------------------------------------------------------------------- commands

class _ParseError(Exception):
    pass


class _Parsed(Exception):
    pass


def _raise_error(self: argparse.ArgumentParser, message: str) -> None:
    raise _ParseError(message)


def _placeholders(message: str) -> list[str] | None:
    """Arguments that stand in for the required ones an argparse error names (a mention leaves them out)."""
    if "the following arguments are required:" not in message:
        return None
    names = message.split("required:", 1)[1].split(",")
    out: list[str] = []
    for n in (n.strip() for n in names):
        out += [n.split("/")[0], "PLACEHOLDER"] if n.startswith("-") else ["PLACEHOLDER"]
    return out


def parse_engine(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None if engine's CLI takes argv (a bench's options by that bench's parser), else argparse's message."""
    from engine import cli

    monkeypatch.setattr(argparse.ArgumentParser, "error", _raise_error)
    parser = cli.build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except _ParseError as err:
            extra = _placeholders(str(err))
            if extra is None:
                raise
            args = parser.parse_args(argv + extra)
        except SystemExit as exit_:  # --help / --version
            return None if exit_.code == 0 else f"exit {exit_.code}"
    except _ParseError as err:
        return str(err)
    if args.command == "bench" and args.extra:
        return _parse_bench_options(cli, args.which, args.extra, monkeypatch)
    return None


def _parse_bench_options(cli, which: list[str], extra: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed  # parsed: stop before the benchmark runs

    for name in which:
        main = importlib.import_module(cli.BENCHMARKS[name]).main
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    main(extra)
            except _Parsed:
                continue
            except _ParseError as err:
                return f"bench {name}: {err}"
        return f"bench {name}: its main() returned without parsing its options"
    return None


def parse_torchrun(options: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    from torch.distributed.run import get_args_parser

    monkeypatch.setattr(argparse.ArgumentParser, "error", _raise_error)
    try:
        get_args_parser().parse_args([*options, "script.py"])
    except _ParseError as err:
        return str(err)
    return None


def engine_calls(name: str, text: str) -> list[tuple[str, list[str], list[str] | None]]:
    """(where, engine argv, torchrun options or None) of every engine command a page names."""
    calls = []
    for code in code_of(name, text):
        match = ENGINE_CALL.search(code.text)
        if match is None:
            continue
        args = re.sub(r"[\[\]]", "", match["args"])  # `bench [quantize,gemm]`: an optional part, checked too
        argv = shlex.split(args, comments=True)
        if not argv:
            continue  # the entry point alone (`python -m engine`, the `engine` console script)
        torchrun = shlex.split(match["torchrun"])[1:] if match["torchrun"] else None
        calls.append((code.where, argv, torchrun))
    return calls


def command_problems(name: str, text: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    problems = []
    for where, argv, torchrun in engine_calls(name, text):
        message = parse_engine(argv, monkeypatch)
        if message is not None:
            problems.append(f"{where}: `engine {shlex.join(argv)}`: {message}")
        if torchrun is not None and (message := parse_torchrun(torchrun, monkeypatch)) is not None:
            problems.append(f"{where}: torchrun {shlex.join(torchrun)}: {message}")
    for match in re.finditer(r"^```python\n# run with: torchrun (.*?) ?[\w.-]+\.py$", text, re.M):
        if (message := parse_torchrun(shlex.split(match[1]), monkeypatch)) is not None:
            problems.append(f"{name}:{_line(text, match.start()) + 1}: torchrun {match[1]}: {message}")
    return problems


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w.\- ]+):(?!=)", text, re.M) for t in line.split()}


def make_problems(name: str, text: str) -> list[str]:
    targets = make_targets()
    return [f"{code.where}: `make {m['target']}`: the Makefile has no such target (it has {sorted(targets)})"
            for code in code_of(name, text) for m in MAKE_CALL.finditer(code.text) if m["target"] not in targets]


# ---------------------------------------------------------------------------------------------- tests

def pages() -> list[tuple[Path, str, str]]:
    return [(page, str(page.relative_to(ROOT)), page.read_text()) for page in DOCS]


def test_named_paths_exist():
    problems = [p for _, name, text in pages() for p in path_problems(name, text)]
    assert not problems, "\n".join(problems)
    assert sum(len(PATH.findall(c.text)) for _, name, text in pages() for c in code_of(name, text)) >= 30


def test_architecture_tree_is_todays_code():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert len(tree_entries("docs/architecture.md", text)) >= 80
    problems = [p for _, name, text in pages() for p in tree_problems(name, text)]
    assert not problems, "\n".join(problems)


def test_links_resolve():
    problems = [p for page, _, text in pages() for p in link_problems(page, text)]
    assert not problems, "\n".join(problems)
    readme = (ROOT / "README.md").read_text()
    linked = {Path(m).name for m in re.findall(r"\]\(docs/([\w-]+\.md)", readme)}
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}, "the README's table links every docs page"


def test_engine_commands_parse(monkeypatch):
    calls = [c for _, name, text in pages() for c in engine_calls(name, text)]
    assert {argv[0] for _, argv, _ in calls} >= {"train", "bench", "eval", "generate", "formats", "info"}
    problems = [p for _, name, text in pages() for p in command_problems(name, text, monkeypatch)]
    assert not problems, "\n".join(problems)


def test_make_targets_exist():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    problems = [p for _, name, text in pages() for p in make_problems(name, text)]
    assert not problems, "\n".join(problems)


# The checks themselves catch what they are for (each on a page written here, not on the real docs).

PLANTED = """# A page

The reference is `engine/ops/blocked.py`, and `csrc/kernels_nope*.cpp` its kernels; `engine/ops/reference.py:12` exists.
See [the set-up](README.md#no-such-heading), [shared](../shared/notes.md) and [gone](docs/gone.md).

```sh
python -m engine trian --steps 3
python -m engine train --stepz 3
python -m engine train --recipes delayed,fp9
python -m engine bench quantize --sise 8 8
torchrun --nproc-per-rank 2 -m engine train
make tests
```

`python -m engine eval` and `engine generate` are mentions; `make demo` is real.

```
engine/
  ops/
    blocked.py          gone
    reference.py        here
```
"""


def test_checks_catch_planted_mistakes(monkeypatch):
    page = ROOT / "planted.md"  # never written: the checks read the text given
    paths = path_problems("planted.md", PLANTED)
    assert [p.split(": ", 1)[1] for p in paths] == ["`engine/ops/blocked.py` does not exist",
                                                    "`csrc/kernels_nope*.cpp` does not exist"]
    links = link_problems(page, PLANTED)
    assert len(links) == 3 and "no heading with the anchor #no-such-heading" in links[0]
    assert "outside the repository" in links[1] and "does not exist" in links[2]
    commands = command_problems("planted.md", PLANTED, monkeypatch)
    assert len(commands) == 5, commands
    assert "invalid choice: 'trian'" in commands[0] and "--stepz" in commands[1] and "fp9" in commands[2]
    assert "--sise" in commands[3] and "--nproc-per-rank" in commands[4]
    assert [p.split(": ", 1)[1][:12] for p in make_problems("planted.md", PLANTED)] == ["`make tests`"]
    tree = tree_problems("planted.md", PLANTED)
    assert "`engine/ops/blocked.py` does not exist" in tree[0]
    assert any("`engine/ops/` but not" in p and "'nvfp4.py'" in p for p in tree)
    assert any("`engine/` but not" in p and "'schemes.py'" in p for p in tree)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
