"""engine's imports only go down the layers, and no engine module takes part in an import cycle.

Every `.py` file under `engine/` is parsed with `ast`: module-level imports AND the ones inside functions
(the ones that hid a 54-module cycle), relative forms (`from . import x`), and `importlib.import_module(
"engine...")` / `__import__("engine...")` with a literal name. `LAYERS` below is the contract (the one place
it is written down; docs/architecture.md describes it): a module may import its own component and any
component of a lower layer, never one of a higher layer nor a sibling of its own layer. What a lower layer
needs from a higher one moves down or is registered from above (`engine.hooks`).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "engine"

#: bottom to top. A layer lists its components, separated by " | " (independent: none imports another);
#: a component is one or more modules or packages, separated by ", ". `engine` alone is the package's
#: __init__ (the public names): it sits above every layer it re-exports and below the demo.
LAYERS: tuple[str, ...] = (
    # no engine imports: malloc tuning, device queries, amax all-reduce, DTensor recognition, hooks
    "engine.memory | engine.device | engine.collectives | engine.dtensor | engine.hooks | engine.cli_types",
    "engine.formats",
    "engine.schemes",
    "engine.ops",
    "engine.checks",  # argument checks of the public API (it reads ops.reference's dtype list)
    "engine.tensors",
    "engine.quantizers | engine.gemm",
    "engine.recipes",
    "engine.autocast | engine.machine",  # machine: what `engine info` reports of the CPU and each recipe
    "engine.recompute | engine.parameters",  # engine.checkpoint replays autocast; FP8 primary weights
    "engine.modules",
    "engine.distributed | engine.inference | engine.numerics | engine.moe | engine.optim",  # numerics: engine.inspect; moe: MoE; optim: optimizers
    "engine.conversion, engine.conversion_layers, engine.conversion_experts",  # convert / unconvert also move quantize_'s weights (Conv1D)
    "engine",
    "engine.train",  # the demo: training, and the eval / generate commands over its model
    "engine.cli, engine.__main__",
)


@dataclass(frozen=True)
class Component:
    layer: int
    name: str  # how the table spells it
    members: tuple[str, ...]


def components(layers: tuple[str, ...] = LAYERS) -> list[Component]:
    return [Component(i, part.strip(), tuple(m.strip() for m in part.split(",")))
            for i, layer in enumerate(layers) for part in layer.split("|")]


def component_of(module: str, table: list[Component]) -> Component | None:
    """The component of `module`: the longest member that is it or a package holding it (`engine` holds only
    itself, so a new module is never placed by accident)."""
    best, length = None, -1
    for comp in table:
        for member in comp.members:
            inside = module == member or (member != PACKAGE and module.startswith(member + "."))
            if inside and len(member) > length:
                best, length = comp, len(member)
    return best


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: str
    line: int
    local: bool  # inside a function


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan_source(source: str, module: str, is_package: bool, known: set[str], path: str = "<source>") -> list[Import]:
    """Every import of an engine module in `source` (module `module`), wherever it is in the file."""
    base = module.split(".") if is_package else module.split(".")[:-1]  # what `from . import` is relative to
    found: list[Import] = []

    def add(target: str, node: ast.AST, local: bool) -> None:
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            return
        while target not in known and "." in target:  # `import engine.x.name` of a name: its module
            target = target.rsplit(".", 1)[0]
        imp = Import(module, target, path, node.lineno, local)
        if imp not in found:  # `from engine.x import a, b`: one import of engine.x
            found.append(imp)

    def visit(node: ast.AST, local: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, local)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(base):
                    raise ValueError(f"{path}:{node.lineno}: a relative import above the top package")
                parent = base[: len(base) - (node.level - 1)]
                source_module = ".".join(parent + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            for alias in node.names:  # `from engine import formats` imports the module engine.formats
                sub = f"{source_module}.{alias.name}"
                add(sub if sub in known else source_module, node, local)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                add(node.args[0].value, node, local)
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, filename=path), False)
    return found


def engine_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def scan_engine(root: Path = ROOT) -> list[Import]:
    modules = engine_modules(root)
    known = set(modules)
    return [imp for name, path in modules.items()
            for imp in scan_source(path.read_text(), name, path.name == "__init__.py", known,
                                   str(path.relative_to(root)))]


def climbing(imports: list[Import], table: list[Component]) -> list[str]:
    """Each import that goes up a layer or sideways to a sibling, as `file:line: importer (layer) -> imported`."""
    bad = []
    for imp in imports:
        src, dst = component_of(imp.importer, table), component_of(imp.imported, table)
        if src is None or dst is None or src == dst or dst.layer < src.layer:
            continue
        how = "a sibling of its layer" if dst.layer == src.layer else "a higher layer"
        bad.append(f"{imp.path}:{imp.line}: {imp.importer} (layer {src.layer}, {src.name}) imports "
                   f"{imp.imported} ({how}: layer {dst.layer}, {dst.name}){' inside a function' if imp.local else ''}")
    return bad


def cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.importer != imp.imported:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    members.append(top)
                    if top == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


# ------------------------------------------------------------------------------------------ the contract
def test_every_engine_module_has_one_place_in_the_table() -> None:
    table = components()
    modules = engine_modules()
    unplaced = [m for m in modules if component_of(m, table) is None]
    assert not unplaced, f"modules with no layer: {unplaced}; add them to LAYERS in tests/test_layers.py"
    named = [member for comp in table for member in comp.members]
    assert len(named) == len(set(named)), f"a module is named twice in LAYERS: {sorted(named)}"
    missing = [m for m in named if not any(x == m or x.startswith(m + ".") for x in modules)]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"


def test_imports_only_go_down() -> None:
    bad = climbing(scan_engine(), components())
    assert not bad, f"{len(bad)} imports climb the layers (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


def test_no_import_cycle_among_engine_modules() -> None:
    imports = scan_engine()
    found = cycles(imports)
    where = {(i.importer, i.imported): f"{i.path}:{i.line}" for i in imports}
    lines = []
    for members in found:
        inside = set(members)
        edges = sorted(f"    {where[a, b]}: {a} -> {b}" for (a, b) in where if a in inside and b in inside)
        lines.append(f"a cycle of {len(members)} modules: {', '.join(members)}\n" + "\n".join(edges))
    assert not found, "\n".join(lines)


def test_import_engine_registers_every_hook() -> None:
    """What the lower layers call through `engine.hooks` is set once `import engine` has run."""
    import engine  # noqa: F401
    from engine.hooks import Hook

    hooks = {f"{name}.{attr}": value for name, module in list(sys.modules.items())
             if name == PACKAGE or name.startswith(PACKAGE + ".")
             for attr, value in vars(module).items() if isinstance(value, Hook)}
    assert len(hooks) >= 6, sorted(hooks)  # FSDP2 pre/post all-gather, sharded components x2, DTensor linear, pickling
    assert not [name for name, hook in hooks.items() if not hook.registered], hooks


# ------------------------------------------------------------------------------------------ the checker itself
KNOWN = {"engine", "engine.ops", "engine.ops.reference", "engine.tensors", "engine.tensors.quantized",
         "engine.distributed", "engine.distributed.fsdp", "engine.formats"}
SOURCE = '''
import torch
import engine.formats
from engine.ops import reference
from . import quantized as q
from .. import formats
from ..distributed.fsdp import pre_all_gather
import importlib

def f():
    from engine.distributed import fsdp
    importlib.import_module("engine.distributed")

class C:
    def method(self):
        import engine.tensors.quantized.QuantizedTensor
        return __import__("engine.ops.reference")
'''


def test_the_scan_sees_every_import_form() -> None:
    found = scan_source(SOURCE, "engine.tensors.storage", False, KNOWN)
    got = [(i.imported, i.line, i.local) for i in found]
    assert got == [
        ("engine.formats", 3, False), ("engine.ops.reference", 4, False), ("engine.tensors.quantized", 5, False),
        ("engine.formats", 6, False), ("engine.distributed.fsdp", 7, False), ("engine.distributed.fsdp", 11, True),
        ("engine.distributed", 12, True), ("engine.tensors.quantized", 16, True), ("engine.ops.reference", 17, True),
    ]
    in_package = scan_source("from . import quantized\nfrom .quantized import X, Y\n", "engine.tensors", True, KNOWN)
    assert [(i.imported, i.line) for i in in_package] == [("engine.tensors.quantized", 1), ("engine.tensors.quantized", 2)]


def test_a_climbing_import_and_a_cycle_are_named() -> None:
    table = components(("engine.formats", "engine.ops | engine.tensors", "engine.distributed", "engine"))
    imports = scan_source(SOURCE, "engine.tensors.storage", False, KNOWN, "engine/tensors/storage.py")
    bad = climbing(imports, table)
    assert bad == [
        "engine/tensors/storage.py:4: engine.tensors.storage (layer 1, engine.tensors) imports engine.ops.reference "
        "(a sibling of its layer: layer 1, engine.ops)",
        "engine/tensors/storage.py:7: engine.tensors.storage (layer 1, engine.tensors) imports engine.distributed.fsdp "
        "(a higher layer: layer 2, engine.distributed)",
        "engine/tensors/storage.py:11: engine.tensors.storage (layer 1, engine.tensors) imports "
        "engine.distributed.fsdp (a higher layer: layer 2, engine.distributed) inside a function",
        "engine/tensors/storage.py:12: engine.tensors.storage (layer 1, engine.tensors) imports engine.distributed "
        "(a higher layer: layer 2, engine.distributed) inside a function",
        "engine/tensors/storage.py:17: engine.tensors.storage (layer 1, engine.tensors) imports engine.ops.reference "
        "(a sibling of its layer: layer 1, engine.ops) inside a function",
    ]
    chain = [Import(a, b, "x.py", 1, False) for a, b in (("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"))]
    assert cycles(chain) == [["a", "b", "c"]]
    assert cycles(chain[:2] + chain[3:]) == []


@pytest.mark.parametrize("module", ["engine", "engine.train.eval", "engine.cli", "engine.tensors.quantized"])
def test_the_table_places_modules_by_longest_name(module: str) -> None:
    table = components()
    want = {"engine": "engine", "engine.train.eval": "engine.train", "engine.cli": "engine.cli, engine.__main__",
            "engine.tensors.quantized": "engine.tensors"}
    assert component_of(module, table).name == want[module]
    assert component_of("engine.unplaced_new_module", table) is None


def test_an_unset_hook_names_who_sets_it() -> None:
    from engine.hooks import Hook

    hook = Hook("the thing a lower layer calls", "engine.upper")
    with pytest.raises(RuntimeError, match=r"the thing a lower layer calls is provided by engine\.upper"):
        hook(1)
    with pytest.raises(TypeError, match="expected a callable, got int"):
        hook.register(3)
    assert hook.register(abs) is abs and hook(-2) == 2 and hook.registered
