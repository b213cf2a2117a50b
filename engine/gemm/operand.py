"""GemmOperand: what one side of out = A @ B^T looks like to a GEMM, read from a storage's scheme.

A GEMM reads K-major operands: `data` [rows, K] with scales along K. `gemm_operand` asks the
storage for the usage op(t) reads (rowwise data for t, columnwise data for t^T) and turns the
scheme's block into the operand's tile; nothing here looks at scale values to decide numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.formats import E2M1
from engine.ops import mx_elements
from engine.ops import quantize as ops
from engine.ops import reference as ref
from engine.schemes import ScaleEncoding, dims_2d
from engine.tensors.quantized import QuantizedTensor, storage_of
from engine.tensors.storage import QuantizedTensorBase

@dataclass(slots=True)  # built for every GEMM call: slots, and not frozen (a frozen init costs ~2 us more)
class GemmOperand:
    """One K-major side of a GEMM: FP8 `data` [rows, K] and its scale_inv.

    `scale_inv` is [1] (per tensor), or one scale per tile of `tile_rows x tile_cols`
    (fp32, or uint8 E8M0 codes), shaped [ceil(rows/tile_rows), ceil(K/tile_cols)].
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    per_tensor: bool
    encoding: ScaleEncoding
    tile_rows: int = 1
    tile_cols: int = 1
    #: NVFP4: the usage's fp32 per-tensor amax (values are data * scale * amax / amax_divisor)
    amax: torch.Tensor | None = None
    #: NVFP4: 6 * E, E the scheme's `tensor_scale_max` (448; 256 under 4over6)
    amax_divisor: float = 2688.0
    #: E2M1 elements (MX e2m1, NVFP4): the stored codes, 2D, two per byte, element 2i in the low nibble: packed
    #: along K (`[rows, ceil(K/2)]`), or along the rows when `stored_codes_along_rows` (MX columnwise data
    #: kept in x's layout, `[K, ceil(rows/2)]`). `codes` gives them K-major; `data` holds their bf16 values.
    stored_codes: torch.Tensor | None = None
    stored_codes_along_rows: bool = False

    @property
    def codes(self) -> torch.Tensor | None:
        """E2M1 codes packed along K, `[rows, ceil(K/2)]` uint8 (what FP4 tensor cores read); None for others.
        Repacked here (unpack, transpose, pack) when stored along the rows: only the FP4 GEMMs pay for it."""
        if self.stored_codes is None or not self.stored_codes_along_rows:
            return self.stored_codes
        return mx_elements.pack(mx_elements.unpack(self.stored_codes, E2M1, self.rows).t(), E2M1)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def kind(self) -> str:
        """Which GEMM numerics apply: one scale ("tensor"), power-of-2 tiles ("pow2"), fp32 tiles ("block")."""
        if self.per_tensor:
            return "tensor"
        if self.encoding is ScaleEncoding.E4M3:
            return "nvfp4"
        return "pow2" if self.encoding.is_pow2 else "block"

    @property
    def tile(self) -> tuple[int, int]:
        """(tile_rows, tile_cols), at least 1 each; (0, 0) for one scale per tensor."""
        return (0, 0) if self.per_tensor else (max(self.tile_rows, 1), max(self.tile_cols, 1))

    def tile_scales(self) -> torch.Tensor:
        """fp32 scale_inv per tile (E8M0 codes decoded)."""
        return ref.e8m0_to_float(self.scale_inv) if self.encoding is ScaleEncoding.E8M0 else self.scale_inv.float()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.amax is not None:  # NVFP4: TE's dequantize, (scale * amax) * fp32(1 / (6 E)) per block
            factor = self.tile_scales() * self.amax.float().reshape(()) * (1.0 / self.amax_divisor)
            return ref.dequantize_block(self.data, factor, tile_rows=1, tile_cols=self.tile_cols, dtype=dtype)
        if self.per_tensor:
            return (self.data.float() * self.scale_inv.float()).to(dtype)
        return ref.dequantize_block(self.data, self.tile_scales(), tile_rows=self.tile_rows,
                                    tile_cols=self.tile_cols, dtype=dtype)


def is_high_precision(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor)


def gemm_operand(t: QuantizedTensor | QuantizedTensorBase, *, transposed: bool, name: str = "a") -> GemmOperand:
    """The K-major operand for op(t): rowwise data, or columnwise data when `transposed`."""
    st = t if isinstance(t, QuantizedTensorBase) else storage_of(t, name)
    data = st.columnwise_data if transposed else st.rowwise_data
    scale_inv = st.columnwise_scale_inv if transposed else st.rowwise_scale_inv
    if data is None:
        usage = "columnwise" if transposed else "rowwise"
        raise ValueError(f"{name}: the GEMM needs its {usage} data, but this {type(st).__name__} has only "
                         f"{'rowwise' if transposed else 'columnwise'} data; quantize with {usage} usage")
    scheme = st.scheme
    if scheme.per_tensor_fp8_usages[transposed] and data.dim() == 2:
        return GemmOperand(data, scale_inv, True, scheme.scale)  # per-tensor FP8, 2D: what every step reads
    nvfp4 = scheme.tensor_scale  # two scale levels: the block scales times the usage amax / (6 * 448)
    codes = None
    if nvfp4:  # NVFP4 codes: columnwise data is [K, M] (packed along M); exact bf16 values
        m, k = dims_2d(st.shape)
        codes = data if transposed else ref.as_2d(data)
        data = ops.elements_to_bf16(data, scheme, cols=m if transposed else k)
    elif scheme.coded:  # MX E2M1/E2M3/E3M2 codes (both usages in x's shape): exact bf16 values, read as FP8 data
        if scheme.element is E2M1:
            codes = ref.as_2d(data)
        data = ops.elements_to_bf16(data, scheme, cols=st.shape[-1] if len(st.shape) else 1)
    block = scheme.stored_block(transposed)
    data2d = data if data.dim() == 2 or (transposed and scheme.columnwise_transposed) else ref.as_2d(data)
    if transposed and not scheme.columnwise_transposed:  # stored in x's shape: read it as [K, M]
        data2d, scale_inv, block = data2d.t(), scale_inv.t(), block.transposed()
    if nvfp4:
        return GemmOperand(data2d, scale_inv, False, scheme.scale, 1, block.cols,
                           st.amax_columnwise if transposed else st.amax_rowwise, 6.0 * scheme.tensor_scale_max,
                           stored_codes=codes)
    if block.is_tensor:
        return GemmOperand(data2d, scale_inv, True, scheme.scale)
    return GemmOperand(data2d, scale_inv, False, scheme.scale, *block.tile(*data2d.shape), stored_codes=codes,
                       stored_codes_along_rows=codes is not None and transposed)


def as_matrix(t: QuantizedTensor | QuantizedTensorBase | torch.Tensor, transposed: bool, dtype: torch.dtype,
              name: str) -> torch.Tensor:
    """op(t) in `dtype`: a high-precision tensor as it is, a quantized one dequantized from the usage op reads."""
    if is_high_precision(t):
        t2d = ref.as_2d(t)
        return (t2d.t() if transposed else t2d).to(dtype)  # op(t): t [M, K], or t^T for a [K, M] tensor
    st = storage_of(t, name)
    if transposed and st.scheme.columnwise_transform is not None:  # columnwise data of the transformed transpose
        return ref.as_2d(st.dequantize(dtype)).t()
    return gemm_operand(t, transposed=transposed, name=name).dequantize(dtype)
