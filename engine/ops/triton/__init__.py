"""Triton kernels for quantization on CUDA tensors (the `triton` backend of `engine.ops.backend`).

Same functions, signatures and bits as `engine.ops.reference`:

* `amax(x)`                      -> fp32 [1]                      (cast_transpose.py)
* `cast_transpose(x2d, scale, fp8_dtype, *, rowwise, columnwise)`   (cast_transpose.py)
* `quantize_block(x2d, fp8_dtype, *, tile_rows, tile_cols, ...)`    (block.py)
* `quantize_mxfp8(x, fp8_dtype, *, scale_mode, columnwise)`         (mxfp8.py)
* `quantize_mx_coded(x, element, *, scale_mode, rowwise, columnwise)` (mx_small.py: MXFP4 / MXFP6)
* `quantize_nvfp4(x, *, rowwise, columnwise, two_d, rht, amax, amax_t, counter)` (nvfp4.py: NVFP4,
  as `engine.ops.native.quantize_nvfp4`)
* `fp8_to_bf16(data)`                                               (convert.py)

FP8 codes are produced with integer arithmetic (`fp8_bits.py`), not with Triton's float
downcast: that one is wrong under `TRITON_INTERPRET=1` and architecture-dependent on GPUs.
The launchers allocate their outputs on the input's device, so with `TRITON_INTERPRET=1`
(set before this package is imported) they also run on CPU tensors, which is how the
tests check them against the reference without a GPU.
"""

from engine.ops.triton.block import quantize_block
from engine.ops.triton.cast_transpose import amax, cast_transpose
from engine.ops.triton.convert import fp8_to_bf16
from engine.ops.triton.mx_small import quantize_mx_coded
from engine.ops.triton.mxfp8 import quantize_mxfp8
from engine.ops.triton.nvfp4 import quantize_nvfp4

__all__ = ["amax", "cast_transpose", "quantize_block", "quantize_mxfp8", "quantize_mx_coded", "quantize_nvfp4",
           "fp8_to_bf16"]
