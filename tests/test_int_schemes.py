"""The integer schemes (engine.schemes: channel_int8, channel_int8_bf16, group<g>_int4_bf16_asym) and their reference
(engine.ops.int_elements) make the bits engine.quantize_ made before they were schemes: that code is written out
here as it was (`rowwise_int8`, `Int4Format.quantize` with its padding and packing, their dequantize formulas)
and compared bit for bit on random and edge inputs (zero, constant and tied groups, subnormals, fp32's max, inf,
NaN; fp32, bf16 and fp16 weights; N not a multiple of 16, K not one of the group, odd K, empty). A quantize_d
integer weight is a storage of its scheme whose buffers share memory with the kernel's layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.formats import INT4
from engine.inference.weight import QuantizedWeight
from engine.ops import int_elements
from engine.ops import quantize as qops
from engine.schemes import INT4_GROUP_SIZES, SCHEMES, int4_group_scheme, int8_channel_scheme
from engine.tensors import IntTensorStorage, QuantizedTensorBase, rebuild_storage

TINY = torch.finfo(torch.float32).tiny
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------- the code before the schemes, as it was
def old_rowwise_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    amax = wf.abs().amax(dim=1) if wf.shape[1] else wf.new_zeros(wf.shape[0])
    scale = (amax / 127.0).clamp_min(TINY).to(scale_dtype)
    q = torch.round(wf / scale.float().unsqueeze(1)).clamp_(-127.0, 127.0).to(torch.int8)
    return q, scale


def old_int4_parts(w: torch.Tensor, g: int) -> dict[str, torch.Tensor]:
    """Int4Format.quantize: K padded with zeros to the group, N with rows of q 8, scale 1, zero 0."""
    n, k = w.shape
    kg = -(-k // g) * g
    groups = F.pad(w, (0, kg - k)).float().reshape(n, kg // g, g)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(TINY).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - zero.float().unsqueeze(2)) / scale.float().unsqueeze(2)) + 8.0
    q = q.clamp_(0.0, 15.0).to(torch.uint8).reshape(n, kg)
    pad = -n % 16
    if pad:
        q = torch.cat([q, q.new_full((pad, kg), 8)])
        scale = torch.cat([scale, scale.new_ones((pad, scale.shape[1]))])
        zero = torch.cat([zero, zero.new_zeros((pad, zero.shape[1]))])
    return {"data": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
            "scale_and_zero": torch.stack([scale.t(), zero.t()], dim=2).contiguous()}


def old_int4_dequantize(parts: dict[str, torch.Tensor], shape: tuple[int, int], g: int,
                        dtype: torch.dtype) -> torch.Tensor:
    n, k = shape
    data, sz = parts["data"][:n], parts["scale_and_zero"]
    q = torch.stack([data & 15, data >> 4], dim=2).reshape(n, 2 * data.shape[1]).float()
    scale = sz[:, :n, 0].float().t().repeat_interleave(g, dim=1)
    zero = sz[:, :n, 1].float().t().repeat_interleave(g, dim=1)
    return ((q - 8.0) * scale + zero)[:, :k].to(dtype)


# ------------------------------------------------------------------------- inputs
def edge_weight(n: int, k: int, dtype: torch.dtype, seed: int, group: int = 32) -> torch.Tensor:
    """Random rows over 12 binades, then rows (and groups) of the edge cases."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-6, 6, n).unsqueeze(1)
    finfo = torch.finfo(dtype)
    edges = [
        torch.zeros(k),                                         # all zero: the tiny scale
        torch.full((k,), 0.75),                                 # constant: max = min
        torch.arange(k) % 4 - 1.5,                              # ties: halves
        torch.full((k,), finfo.tiny / 4) * (torch.arange(k) % 3 - 1),  # subnormals of the weight's dtype
        torch.full((k,), finfo.max) * torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0),  # max - min overflows
        torch.where(torch.arange(k) == 1, float("inf"), 1.0),   # an inf
        torch.where(torch.arange(k) == 2, float("nan"), -2.0),  # a NaN
        torch.linspace(-1, 1, k) * 127 / 64,                    # codes at exact halves of the int8 grid
        1000 + torch.linspace(0, 0.05, k),                      # far from 0: bf16's rounded zero clamps codes
        torch.linspace(-1, 1, k) * (1 + 2.0 ** -9),             # amax/127 rounded down in bf16: quotients above 127
    ]
    for i, row in enumerate(edges[: n]):
        w[i] = row
    if k > group and n > len(edges):  # one zero group in a random row (int4's zero-group rule inside a row)
        w[len(edges), :group] = 0
    return w.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------- the reference's bits
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (9, 1), (5, 0), (0, 7)])
def test_int8_channel_reference_makes_the_old_bits(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    w = edge_weight(*shape, dtype, seed=shape[1])
    for scale_dtype in (torch.float32, torch.bfloat16):
        scheme = int8_channel_scheme(scale_dtype)
        data, scale_inv = int_elements.quantize(w, scheme)
        q, scale = old_rowwise_int8(w, scale_dtype)
        assert data.dtype == torch.int8 and tuple(scale_inv.shape) == (shape[0], 1)
        assert torch.equal(bits(data), bits(q)) and torch.equal(bits(scale_inv.view(-1)), bits(scale))
        old = (q.float() * scale.float().unsqueeze(1)).to(torch.float32)
        storage = QuantizedTensorBase(scheme=scheme, shape=w.shape, nominal_dtype=dtype, rowwise_data=data,
                                      rowwise_scale_inv=scale_inv)
        assert torch.equal(bits(storage.dequantize(torch.float32)), bits(old))


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_group_reference_and_saved_parts_make_the_old_bits(group: int, dtype: torch.dtype) -> None:
    """The storage's codes, scales and zeros, the parts it saves as (the kernel's padded layout) and its
    dequantize, against the old Int4Format's, for K a multiple of the group, not one, and odd."""
    fmt = engine.inference.formats.format_of(engine.Int4WeightOnly(group_size=group))
    for n, k in ((40, 2 * group), (37, group + 10), (16, group - 1), (3, 0), (0, group)):
        w = edge_weight(n, k, dtype, seed=k, group=group)
        storage = fmt.quantize(w)
        assert type(storage) is IntTensorStorage and storage.scheme is int4_group_scheme(group)
        parts, old = fmt.to_parts(storage), old_int4_parts(w, group)
        assert list(parts) == list(old)
        for name in old:
            assert torch.equal(bits(parts[name]), bits(old[name])), (n, k, name)
        kg = -(-k // group) * group
        old_sz = old["scale_and_zero"][:, :n].transpose(0, 1)
        assert torch.equal(bits(storage.rowwise_scale_inv), bits(old_sz))
        codes = torch.stack([old["data"][:n] & 15, old["data"][:n] >> 4], dim=2).reshape(n, kg)[:, :k]
        assert torch.equal(int_elements.load(storage.rowwise_data, INT4, k), codes.float() - 8)
        for out in (torch.float32, torch.bfloat16, torch.float64):
            assert torch.equal(bits(storage.dequantize(out)), bits(old_int4_dequantize(old, (n, k), group, out)))


def test_int4_odd_k_packs_a_high_nibble_of_zero() -> None:
    """An odd K ends in a byte whose high nibble is 0 (E2M1's rule), in the storage quantize makes."""
    storage = int_elements.quantize(torch.ones(2, 33), int4_group_scheme(32))[0]
    assert storage.shape == (2, 17) and bool(((storage[:, -1] >> 4) == 0).all())


@pytest.mark.parametrize("name", sorted(n for n, s in SCHEMES.items() if s.integer))
def test_engine_quantize_takes_the_integer_schemes(name: str, monkeypatch) -> None:
    """engine::quantize (its reference backend) quantizes an integer scheme: rowwise as the old code did, and the
    columnwise usage, per column of x stored [K, M], as the old code on x's transpose."""
    monkeypatch.setenv("ENGINE_BACKEND", "reference")
    scheme = SCHEMES[name]
    x = edge_weight(24, 64, torch.bfloat16, seed=1)
    buffers, amax = qops.quantize(x, scheme, rowwise=True, columnwise=True)
    assert amax is None
    for columnwise, source in ((False, x), (True, x.t())):
        usage = "columnwise" if columnwise else "rowwise"
        if scheme.zero_point:
            g = scheme.rowwise_block.cols
            old = old_int4_parts(source, g)
            n, k = source.shape  # (K even here: the old layout's first K/2 bytes of a row are the storage's)
            assert torch.equal(bits(buffers[f"{usage}_scale_inv"]), bits(old["scale_and_zero"][:, :n].transpose(0, 1)))
            assert torch.equal(buffers[f"{usage}_data"], old["data"][:n, : k // 2])
        else:
            q, scale = old_rowwise_int8(source, scheme.scale.dtype)
            assert torch.equal(buffers[f"{usage}_data"], q)
            assert torch.equal(bits(buffers[f"{usage}_scale_inv"].view(-1)), bits(scale))
    with pytest.raises(ValueError, match="scale / amax_epsilon: .* takes its scales from each block"):
        qops.quantize(x, scheme, rowwise=True, columnwise=False, scale=torch.tensor([2.0]))


# ------------------------------------------------------------------------- the storage of a quantize_d weight
CONFIGS = [engine.Int8WeightOnly(), engine.Int8DynamicActivationInt8Weight(), engine.Int4WeightOnly(group_size=64)]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("shape", [(48, 128), (40, 100)])
def test_a_quantized_weight_is_a_storage_of_its_scheme(config, shape: tuple[int, int]) -> None:
    """Rowwise buffers of the [N, K] weight in the scheme's shapes; dequantize() is the storage's; the int4 storage
    views the kernel's padded layout (no second copy: the weight holds the parts' bytes only)."""
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16)
    q = QuantizedWeight.from_float(w, config)
    st = q.storage
    want = {engine.Int8WeightOnly(): "channel_int8_bf16", engine.Int8DynamicActivationInt8Weight(): "channel_int8",
            engine.Int4WeightOnly(group_size=64): "group64_int4_bf16_asym"}[config]
    assert isinstance(st, IntTensorStorage) and st.scheme.name == want and st.shape == shape
    assert not st.has_columnwise
    specs = st.scheme.buffer_specs(shape, rowwise=True, columnwise=False)
    assert {f: (tuple(t.shape), t.dtype) for f, t in st.buffers().items() if t is not None} == specs
    assert torch.equal(bits(q.dequantize(torch.float32)), bits(st.dequantize(torch.float32)))
    assert torch.equal(bits(q.t().dequantize(torch.float32)), bits(st.dequantize(torch.float32).t()))
    parts = q.plain_parts()
    for field, part in q.fmt.PARTS.items():
        held = getattr(st, field).untyped_storage().data_ptr()
        assert held == q.operands[part].untyped_storage().data_ptr() or q.operands[part].is_mkldnn, (field, part)
    assert q.nbytes_quantized() == sum(t.numel() * t.element_size() for t in parts.values())


def test_int4_padding_is_checked_at_load() -> None:
    """A checkpoint whose padding holds what quantize_ never makes there is refused, naming the key; the same
    checkpoint with its padding as made loads (and saves back the same bytes)."""
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return engine.quantize_(torch.nn.Sequential(torch.nn.Linear(100, 40, bias=False)).bfloat16(),
                                engine.Int4WeightOnly(group_size=64))

    state = make(0).state_dict()
    for key, index in (("0.weight", (45, 0)), ("0.weight", (3, 63)), ("0.weight_scale_and_zero", (1, 44, 0))):
        bad = {k: v.clone() for k, v in state.items()}
        bad[key][index] = 1 if key == "0.weight" else 2.0  # a padded row / the codes of K's padding / a scale
        with pytest.raises(ValueError, match=rf"^{key}: the padding \(rows from 40 to 48, columns from 100 to 128\)"):
            make(1).load_state_dict(bad)
    target = make(1)
    target.load_state_dict(state)
    assert all(torch.equal(bits(v), bits(state[k])) for k, v in target.state_dict().items())


def test_an_integer_storage_round_trips_through_its_plain_form_and_checks_zero_points() -> None:
    """to_plain / rebuild_storage (how a pickled storage loads) of an int4 storage, and the checks of its values:
    a negative scale or a NaN zero point is refused naming the buffer."""
    st = engine.inference.formats.format_of(engine.Int4WeightOnly(group_size=32)).quantize(torch.randn(8, 64))
    again = rebuild_storage(st.to_plain())
    assert again.scheme is st.scheme and torch.equal(again.dequantize(), st.dequantize())
    for index, value, match in (((1, 0, 0), -1.0, r"scales > 0"), ((2, 1, 1), float("nan"), r"zeros \(\[\.\.\., 1\]\)")):
        plain = st.to_plain()
        plain["rowwise_scale_inv"] = plain["rowwise_scale_inv"].clone()
        plain["rowwise_scale_inv"][index] = value
        with pytest.raises(ValueError, match=rf"^rowwise_scale_inv: expected finite {match}"):
            rebuild_storage(plain)
    plain = st.to_plain()
    plain["rowwise_scale_inv"] = plain["rowwise_scale_inv"].clone()
    plain["rowwise_scale_inv"][0, 0, 1] = -3.0  # a negative zero point is a value quantizing makes
    rebuild_storage(plain)
