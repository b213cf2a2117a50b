"""A format is its scheme's fields: no engine code outside `engine/schemes.py` asks a scheme's layout name what
it is, and every layout fact follows from the fields.

The first test parses every `.py` file under `engine/` (functions included) and fails on a comparison of a
`.layout` attribute with a string or a collection of strings (`==`, `!=`, `in`, `not in`), on a
`.layout.startswith(...)` / `.endswith(...)`, and on a `.layout` used as a dict key of a literal dict. The
name stays usable as a name (the scheme's name, the kernel table's key). The others check the facts derived
from the fields against what each family is known to be (TE's and the OCP MX spec's layouts), written out
here by hand, so a wrong derivation or a wrong field fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.schemes import AMAX_FIELDS, BUFFER_FIELDS, SCHEMES, Block, get_scheme

ROOT = Path(__file__).resolve().parent.parent / "engine"


def _is_layout(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "layout"


def _is_strings(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_strings(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id.isupper() and "LAYOUT" in node.id  # NVFP4_LAYOUTS and kin


def layout_questions(source: str) -> list[int]:
    """Line numbers where `source` asks a `.layout` what it is by its name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_layout(s) for s in sides) and any(_is_strings(s) for s in sides):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and _is_layout(node.func.value):
            found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and _is_layout(node.slice):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                isinstance(node.func.value, ast.Dict) and node.args and _is_layout(node.args[0]):
            found.append(node.lineno)
    return found


def test_the_checker_finds_each_kind_of_question():
    planted = '''
a = s.layout == "nvfp4"
b = s.layout in ("mx", "tensor")
c = s.scheme.layout.startswith("nvfp4")
d = {"block1d": 1, "block2d": 2}.get(s.layout)
e = "mx" != q.scheme.layout
f = x.layout is torch.strided and x.layout != torch.strided
g = registry.kernel("quantize", s.layout, "cpu")
'''
    assert layout_questions(planted) == [2, 3, 4, 5, 6]


def test_no_layout_name_is_compared_outside_schemes_py():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "schemes.py" and path.parent == ROOT:
            continue
        bad += [f"{path.relative_to(ROOT.parent)}:{line}" for line in layout_questions(path.read_text())]
    assert not bad, f"ask the scheme's fields (engine/schemes.py), not its layout name: {bad}"


# ------------------------------------------------------------------------- facts derived from the fields
#: by hand, per scheme family: (sliceable in rows, derivable usages, gatherable rowwise / columnwise,
#: columnwise token multiple, block_scaling_dim, holds amaxes)
KNOWN = {
    "tensor_e4m3": (True, True, (True, True), 1, None, False),
    "block1d_e4m3": (True, False, (True, True), 1, 1, False),
    "block2d_e5m2_pow2": (True, True, (True, True), 1, 2, False),
    "mx_e4m3": (True, False, (True, True), 1, None, False),
    "mx_e2m1": (True, False, (True, True), 1, None, False),
    "axiswise_e4m3": (False, False, (True, True), 1, None, False),
    "nvfp4_e2m1": (False, False, (False, False), 1, None, True),
    "nvfp4_rht_e2m1": (False, False, (False, False), 16, None, True),
    # int8 per channel (quantize_'s weights, int8 dynamic's tokens): axiswise's blocks, so not sliceable either
    "channel_int8": (False, False, (True, True), 1, None, False),
    "channel_int8_bf16": (False, False, (True, True), 1, None, False),
    # int4 per group of 32..256 along K with zero points: 1 x g tiles slice by rows, bf16 scales are no FP8 tiles
    "group32_int4_bf16_asym": (True, False, (True, True), 1, None, False),
    "group128_int4_bf16_asym": (True, False, (True, True), 1, None, False),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_derived_facts_are_those_of_the_format(name):
    s = get_scheme(name)
    sliceable, derivable, gatherable, multiple, dim, amaxes = KNOWN[name]
    assert s.sliceable is sliceable and s.derivable is derivable
    assert (s.gatherable(False), s.gatherable(True)) == gatherable
    assert (s.row_multiple(False), s.row_multiple(True)) == (1, multiple)
    assert s.block_scaling_dim == dim
    assert s.fields == BUFFER_FIELDS + (AMAX_FIELDS if amaxes else ())
    assert s.usage_fields(True) == ("columnwise_data", "columnwise_scale_inv") + (("amax_columnwise",) if amaxes
                                                                                   else ())


def test_buffer_specs_follow_the_fields():
    """NVFP4 of a [3, 20, 40] tensor, as TE lays it out: codes two a byte along the stored last dim, E4M3 scales
    per 16 of it, columnwise data of the [40, 60] transpose, one fp32 amax per usage."""
    specs = get_scheme("nvfp4_rht_e2m1").buffer_specs((3, 20, 40), rowwise=True, columnwise=True)
    assert specs == {
        "rowwise_data": ((3, 20, 20), torch.uint8), "rowwise_scale_inv": ((60, 3), torch.float8_e4m3fn),
        "amax_rowwise": ((1,), torch.float32),
        "columnwise_data": ((40, 30), torch.uint8), "columnwise_scale_inv": ((40, 4), torch.float8_e4m3fn),
        "amax_columnwise": ((1,), torch.float32),
    }
    mx = get_scheme("mx_e2m1").buffer_specs((64, 33), rowwise=False, columnwise=True)
    assert mx == {"columnwise_data": ((64, 17), torch.uint8), "columnwise_scale_inv": ((2, 33), torch.uint8)}


def test_integer_buffer_specs_follow_the_fields():
    """int4 per 64 along K of a [40, 100] weight: codes two a byte (a partial last byte and group), a (scale, zero)
    pair of bf16 per group; int8 per channel of a [3, 5, 7] tensor: int8 data in its shape, one scale per row of
    the 2D view, fp32 or bf16 as the encoding says; the columnwise usage per column, stored transposed."""
    int4 = get_scheme("group64_int4_bf16_asym")
    assert int4.zero_point and int4.elements_per_byte == 2 and int4.rowwise_block == Block(1, 64)
    assert int4.buffer_specs((40, 101), rowwise=True, columnwise=True) == {
        "rowwise_data": ((40, 51), torch.uint8), "rowwise_scale_inv": ((40, 2, 2), torch.bfloat16),
        "columnwise_data": ((101, 20), torch.uint8), "columnwise_scale_inv": ((101, 1, 2), torch.bfloat16),
    }
    for name, dtype in (("channel_int8", torch.float32), ("channel_int8_bf16", torch.bfloat16)):
        assert get_scheme(name).buffer_specs((3, 5, 7), rowwise=True, columnwise=True) == {
            "rowwise_data": ((3, 5, 7), torch.int8), "rowwise_scale_inv": ((15, 1), dtype),
            "columnwise_data": ((7, 15), torch.int8), "columnwise_scale_inv": ((7, 1), dtype),
        }
    assert sorted(n for n, s in SCHEMES.items() if s.integer) == [
        "channel_int8", "channel_int8_bf16", "group128_int4_bf16_asym", "group256_int4_bf16_asym",
        "group32_int4_bf16_asym", "group64_int4_bf16_asym"]


def test_every_registered_scheme_has_a_name_class_and_a_rule():
    """Each scheme is held by exactly one public name class and scaled by at least one registered rule (an integer
    scheme: by its reference, `engine.ops.int_elements`, what quantize_'s formats quantize with; no float rule
    claims one, which would quantize it with float casts)."""
    from engine.quantizers import RULE_ENTRIES
    from engine.tensors import QuantizedTensorBase

    for scheme in SCHEMES.values():
        holders = [cls.__name__ for cls in QuantizedTensorBase._named if cls.holds(scheme)]
        assert len(holders) == 1, (scheme.name, holders)
        assert scheme.integer or any(entry.fits(scheme) for entry in RULE_ENTRIES.values()), scheme.name
        assert not (scheme.integer and any(entry.fits(scheme) for entry in RULE_ENTRIES.values())), scheme.name
    assert get_scheme("axiswise_e4m3").rowwise_block == Block(1, 0)
