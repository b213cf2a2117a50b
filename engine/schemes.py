"""Schemes: what a quantized tensor looks like, as data.

A scheme says which element format the data has, how many elements share one scale in
each usage, how the columnwise copy is laid out, and how scales are encoded. Every layout
fact (buffer shapes, whether a usage can be derived from the other, which GEMM numerics
are exact) is computed from these fields, in this file only.

Shapes are those of the 2D view every scheme quantizes: `[M, K]`, M = the product of the
leading dims, K = the last dim. A `Block(rows, cols)` is the tile of that view whose
elements share one scale (0 = the whole dim). Rowwise data keeps x's shape; columnwise data
is either the transposed `[K, M]` tensor (`columnwise_transposed`) or x's shape again.
A dim that is not a multiple of its block ends in a partial block, stored compactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import Enum

import torch

from engine.formats import FP8_DTYPES, INT4, INT8, MX_ELEMENTS, FloatFormat, IntFormat, element_name, parse_element

BUFFER_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
AMAX_FIELDS = ("amax_rowwise", "amax_columnwise")


class ScaleEncoding(str, Enum):
    """How scale_inv is stored: any fp32, fp32 powers of two, uint8 E8M0 exponent codes, E4M3 values (NVFP4), or
    bf16 values (the integer weights of a bf16 model)."""

    FP32 = "fp32"
    FP32_POW2 = "fp32_pow2"
    E8M0 = "e8m0"
    E4M3 = "e4m3"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return {ScaleEncoding.E8M0: torch.uint8, ScaleEncoding.E4M3: torch.float8_e4m3fn,
                ScaleEncoding.BF16: torch.bfloat16}.get(self, torch.float32)

    @property
    def is_pow2(self) -> bool:
        """Every scale is a power of two, so applying one to an FP8 value is exact in bf16."""
        return self in (ScaleEncoding.FP32_POW2, ScaleEncoding.E8M0)


@dataclass(frozen=True)
class Block:
    """Elements along M (`rows`) and K (`cols`) of the 2D view that share a scale; 0 = the whole dim."""

    rows: int
    cols: int

    @property
    def is_tensor(self) -> bool:
        return self.rows == 0 and self.cols == 0

    def transposed(self) -> Block:
        return self._transposed

    @functools.cached_property
    def _transposed(self) -> Block:  # built once per block: GEMM operands ask for it on every call
        return Block(self.cols, self.rows)

    def grid(self, m: int, k: int) -> tuple[int, ...]:
        """Shape of the scale tensor for an `[m, k]` tensor (`[1]` for one scale per tensor)."""
        if self.is_tensor:
            return (1,)
        return (_blocks(m, self.rows), _blocks(k, self.cols))

    def tile(self, m: int, k: int) -> tuple[int, int]:
        """(rows, cols) of one tile, with 0 resolved to the dim itself (at least 1)."""
        return (self.rows or max(m, 1), self.cols or max(k, 1))


def _blocks(count: int, block: int) -> int:
    return 1 if block == 0 else -(-count // block)


TENSOR = Block(0, 0)


#: TE's fixed sign vector of the 16-point random Hadamard transform (`get_wgrad_sign_vector`)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@dataclass(frozen=True)
class Transform:
    """An orthonormal transform applied to a usage's data along M before it is quantized: the random Hadamard
    transform (RHT) of `size` points, Sylvester's H times `signs` on its rows, divided by sqrt(size)."""

    kind: str
    size: int
    signs: tuple[int, ...]


RHT16 = Transform("rht", 16, RHT_SIGNS)


@dataclass(frozen=True)
class Scheme:
    """One way of storing a quantized tensor: the fields are the spec, every layout fact derives from them."""

    layout: str  # a name for the family (scheme names, kernel table keys); never compared outside this file
    #: an FP8 torch dtype, an element format torch has no dtype for (formats.MX_ELEMENTS: uint8 codes,
    #: `elements_per_byte` to a byte along the last dim, element 2i in the low nibble), or an integer element
    element: torch.dtype | FloatFormat | IntFormat
    scale: ScaleEncoding  # the block scale level's encoding
    rowwise_block: Block
    columnwise_block: Block  # also in x's [M, K] view: 1D block scaling's columnwise tiles are 128x1
    columnwise_transposed: bool
    elements_per_byte: int = 1  # packing along the stored last dim, the first element in the low bits
    #: a second scale level: one fp32 amax per usage, the block scales encoded relative to it (NVFP4)
    tensor_scale: bool = False
    #: with a tensor-level scale: the E4M3 bound E the tensor amax maps the block scales under (values are
    #: q * s_b * amax / (6 * E)): 448, or 256 for NVFP4 "4over6" (whose block scales reach 1.5x more)
    tensor_scale_max: float = 448.0
    columnwise_transform: Transform | None = None  # the rowwise usage never has one
    #: asymmetric blocks: each scale has a zero point, stored next to it (scale_inv's last dim is (scale, zero)), and
    #: an element's value is code * scale + zero (integer elements, codes over their whole range: int4 -8..7)
    zero_point: bool = False

    @property
    def name(self) -> str:
        element = element_name(self.element)
        suffix = "_pow2" if self.scale is ScaleEncoding.FP32_POW2 and self.layout != "mx" else ""
        suffix += "_bf16" if self.scale is ScaleEncoding.BF16 else ""
        return f"{self.layout}_{element}{suffix}{'_asym' if self.zero_point else ''}"

    # ------------------------------------------------------------------ what derives from the fields
    @property
    def fields(self) -> tuple[str, ...]:
        """The buffers a storage of this scheme holds: data and scale_inv per usage, and each usage's amax with
        a tensor-level scale."""
        return BUFFER_FIELDS + (AMAX_FIELDS if self.tensor_scale else ())

    def usage_fields(self, columnwise: bool) -> tuple[str, ...]:
        usage = "columnwise" if columnwise else "rowwise"
        return tuple(f for f in self.fields if f.startswith(usage) or f.endswith(usage))

    def transform(self, columnwise: bool) -> Transform | None:
        return self.columnwise_transform if columnwise else None

    @property
    def derivable(self) -> bool:
        """Either usage can be made exactly from the other (the same blocks, seen transposed, no transform)."""
        return self.rowwise_block == self.columnwise_block and self.columnwise_transposed and \
            self.columnwise_transform is None

    @property
    def sliceable(self) -> bool:
        """Row slices of a 2D tensor at block boundaries are tensors of the same scheme (FSDP2 shards, TP): no
        block spans all rows unless one scale covers the whole tensor, no tensor-level scale, no transform."""
        whole_m = any(b.rows == 0 and not b.is_tensor for b in (self.rowwise_block, self.columnwise_block))
        return not (whole_m or self.tensor_scale or self.columnwise_transform is not None)

    def gatherable(self, columnwise: bool) -> bool:
        """Shards of one usage along M concatenate into the whole tensor's buffers, as bytes: no tensor-level
        scale (each shard has its own amax) and no transform (it would mix the shards' tokens)."""
        return not self.tensor_scale and self.transform(columnwise) is None

    def row_multiple(self, columnwise: bool) -> int:
        """The usage's transform mixes this many rows (tokens) of x: M must be a multiple of it (1: any M)."""
        t = self.transform(columnwise)
        return 1 if t is None else t.size

    @property
    def block_scaling_dim(self) -> int | None:
        """1 or 2 for FP8 block scaling's 1x128 / 128x128 fp32 tiles (TE's name), else None."""
        if self.scale not in (ScaleEncoding.FP32, ScaleEncoding.FP32_POW2) or self.rowwise_block.cols != BLOCK_128:
            return None
        return {1: 1, BLOCK_128: 2}.get(self.rowwise_block.rows)

    @property
    def data_dtype(self) -> torch.dtype:
        """dtype of the data buffers: the element's torch dtype, or uint8 codes for an element torch has none for."""
        if isinstance(self.element, torch.dtype):
            return self.element
        return self.element.torch_dtype if isinstance(self.element, IntFormat) and self.element.torch_dtype \
            else torch.uint8

    @functools.cached_property
    def per_tensor_fp8_usages(self) -> tuple[bool, bool]:
        """(rowwise, columnwise): is that usage's 2-D data one FP8 scale per tensor, as a GEMM reads it directly.
        Built once per scheme: every GEMM asks."""
        plain = self.rowwise_block.is_tensor and not self.tensor_scale and not self.coded
        return plain, plain and self.columnwise_transposed

    @property
    def coded(self) -> bool:
        """The data holds uint8 float element codes (E2M1 / E2M3 / E3M2), not a torch dtype's values."""
        return isinstance(self.element, FloatFormat)

    @property
    def integer(self) -> bool:
        """Integer elements (int8, packed int4: `engine.ops.int_elements`)."""
        return isinstance(self.element, IntFormat)

    def data_shape(self, shape: torch.Size | tuple[int, ...], columnwise: bool) -> tuple[int, ...]:
        if columnwise and self.columnwise_transposed:
            m, k = dims_2d(shape)
            out = (k, m)
        else:
            out = tuple(shape)
        if self.elements_per_byte > 1 and len(out):  # packed along the last dim (a partial last byte)
            out = (*out[:-1], -(-out[-1] // self.elements_per_byte))
        return out

    def scale_shape(self, shape: torch.Size | tuple[int, ...], columnwise: bool) -> tuple[int, ...]:
        """Shape of scale_inv for a tensor of `shape`, in the orientation its data is stored."""
        m, k = dims_2d(shape)
        if not columnwise:
            grid = self.rowwise_block.grid(m, k)
        elif self.columnwise_transposed:
            grid = self.columnwise_block.transposed().grid(k, m)
        else:
            grid = self.columnwise_block.grid(m, k)
        return (*grid, 2) if self.zero_point else grid

    def buffer_specs(self, shape: torch.Size | tuple[int, ...], *, rowwise: bool,
                     columnwise: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each buffer a tensor of `shape` holds for the given usages (amaxes: fp32 [1])."""
        specs = {}
        for col, wanted in ((False, rowwise), (True, columnwise)):
            if wanted:
                usage = "columnwise" if col else "rowwise"
                specs[f"{usage}_data"] = (self.data_shape(shape, col), self.data_dtype)
                specs[f"{usage}_scale_inv"] = (self.scale_shape(shape, col), self.scale.dtype)
                if self.tensor_scale:
                    specs[f"amax_{usage}"] = ((1,), torch.float32)
        return specs

    def stored_block(self, columnwise: bool) -> Block:
        """The block in the orientation the data is stored (`[K, M]` for transposed columnwise data)."""
        if not columnwise:
            return self.rowwise_block
        return self.columnwise_block.transposed() if self.columnwise_transposed else self.columnwise_block

    @property
    def family(self) -> str:
        """The layout name without the transform (a spec's first form names the transform apart: `rht`)."""
        return self.layout.removesuffix(f"_{self.columnwise_transform.kind}") if self.columnwise_transform \
            else self.layout

    def same_layout(self, other: Scheme) -> bool:
        """The same blocks, levels, transform and packing (the element and the scale encoding may differ)."""
        return dataclasses.replace(self, element=other.element, scale=other.scale, layout=other.layout) == other \
            and self.layout == other.layout

    def with_element(self, element: torch.dtype) -> Scheme:
        return SCHEMES[dataclasses.replace(self, element=element).name]

    def __repr__(self) -> str:
        return f"Scheme({self.name})"


def dims_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(M, K) of the 2D view: M = prod(leading dims), K = last dim (a scalar is 1 x 1)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


BLOCK_128 = 128
MX_BLOCK = 32

LAYOUTS: dict[str, tuple[Block, Block, bool]] = {
    # name: (rowwise block, columnwise block in x's view, columnwise stored transposed)
    "tensor": (TENSOR, TENSOR, True),
    "block1d": (Block(1, BLOCK_128), Block(BLOCK_128, 1), True),
    "block2d": (Block(BLOCK_128, BLOCK_128), Block(BLOCK_128, BLOCK_128), True),
    "mx": (Block(1, MX_BLOCK), Block(MX_BLOCK, 1), False),
    # torchao's axiswise ("rowwise") float8: one scale per row over the whole K, and per column
    # (over the whole M) for the columnwise copy, stored [K, M] with one scale per row again
    "axiswise": (Block(1, 0), Block(0, 1), True),
}


#: the integer layouts (engine.quantize_'s weights, int8 dynamic's activations): one scale per row of the 2D
#: view ("channel": a weight's output channel, an activation's token), or per group of g along K; their
#: columnwise usage (never made by quantize_) per column / per g x 1, stored transposed
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT_LAYOUTS: dict[str, tuple[Block, Block, bool]] = {
    "channel": (Block(1, 0), Block(0, 1), True),
    **{f"group{g}": (Block(1, g), Block(g, 1), True) for g in INT4_GROUP_SIZES},
}


NVFP4_BLOCK = 16
#: NVFP4 (E2M1, an E4M3 scale per 16, one fp32 amax per usage; `engine.ops.nvfp4`): rowwise 1x16 blocks,
#: columnwise 16x1 stored transposed `[K, M]` as TE stores it. Scales are stored per row of the data
#: (16x16 weight tiles repeat theirs on their 16 rows, as TE does), so 1D and 2D share the layout.
#: "nvfp4_rht": the columnwise data is of the RHT'd transpose (inputs and gradients; `engine.ops.nvfp4`).


def _registry() -> dict[str, Scheme]:
    schemes = []
    for element in FP8_DTYPES:
        for layout, (row, col, transposed) in LAYOUTS.items():
            encodings = [ScaleEncoding.E8M0] if layout == "mx" else [ScaleEncoding.FP32, ScaleEncoding.FP32_POW2]
            schemes += [Scheme(layout, element, enc, row, col, transposed) for enc in encodings]
    row, col, transposed = LAYOUTS["mx"]
    schemes += [Scheme("mx", fmt, ScaleEncoding.E8M0, row, col, transposed, 2 if fmt.bits == 4 else 1)
                for fmt in MX_ELEMENTS.values()]
    schemes += [Scheme(layout, MX_ELEMENTS["e2m1"], ScaleEncoding.E4M3, Block(1, NVFP4_BLOCK), Block(NVFP4_BLOCK, 1),
                       True, 2, tensor_scale=True, columnwise_transform=transform)
                for layout, transform in (("nvfp4", None), ("nvfp4_rht", RHT16))]
    # NVFP4 "4over6" with TE's 256 bound (`nvfp4_4over6_e4m3_use_256`); 4over6 never takes the RHT
    schemes += [Scheme("nvfp4_e256", MX_ELEMENTS["e2m1"], ScaleEncoding.E4M3, Block(1, NVFP4_BLOCK),
                       Block(NVFP4_BLOCK, 1), True, 2, tensor_scale=True, tensor_scale_max=256.0)]
    # int8 per channel with fp32 scales, or bf16 scales (a bf16 weight's); int4 per group, asymmetric, bf16
    # scales and zeros, two codes a byte
    schemes += [Scheme("channel", INT8, enc, *INT_LAYOUTS["channel"]) for enc in (ScaleEncoding.FP32,
                                                                                 ScaleEncoding.BF16)]
    schemes += [Scheme(f"group{g}", INT4, ScaleEncoding.BF16, *INT_LAYOUTS[f"group{g}"], elements_per_byte=2,
                       zero_point=True) for g in INT4_GROUP_SIZES]
    by_name = {s.name: s for s in schemes}
    if len(by_name) != len(schemes):
        raise AssertionError("two schemes share a name: the name must say every field that differs")
    return by_name


#: every scheme `engine` can store, by name
SCHEMES: dict[str, Scheme] = _registry()


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"scheme: expected one of {sorted(SCHEMES)}, got {name!r}")
    return SCHEMES[name]


def fp8_scheme(layout: str, element: torch.dtype, *, pow2: bool = False) -> Scheme:
    """The registered scheme of `layout` with `element` (and power-of-2 scales where the layout has a choice)."""
    if element not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {element!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(LAYOUTS)}, got {layout!r}")
    row, col, transposed = LAYOUTS[layout]
    encoding = ScaleEncoding.E8M0 if layout == "mx" else (ScaleEncoding.FP32_POW2 if pow2 else ScaleEncoding.FP32)
    return SCHEMES[Scheme(layout, element, encoding, row, col, transposed).name]


def int8_channel_scheme(scale_dtype: torch.dtype = torch.float32) -> Scheme:
    """int8 with one scale per row of the 2D view, in fp32 or bf16."""
    return SCHEMES["channel_int8_bf16" if scale_dtype == torch.bfloat16 else "channel_int8"]


def int4_group_scheme(group_size: int) -> Scheme:
    """Asymmetric int4 per group of `group_size` along K (one of INT4_GROUP_SIZES), bf16 scales and zeros."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {list(INT4_GROUP_SIZES)}, got {group_size!r}")
    return SCHEMES[f"group{group_size}_int4_bf16_asym"]


def mx_scheme(element: torch.dtype | FloatFormat | str) -> Scheme:
    """The MX scheme (1x32 / 32x1 blocks, E8M0 scales) of an FP8 dtype, an MX element format or its name."""
    return SCHEMES[f"mx_{element_name(parse_element(element))}"]
