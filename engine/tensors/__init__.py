"""What a quantized value is: storages (buffers + metadata) and torch.Tensor wrappers over them."""

from engine.tensors.blockwise import Float8BlockwiseTensor, Float8BlockwiseTensorStorage
from engine.tensors.float8 import Float8Tensor, Float8TensorStorage
from engine.tensors.mxfp8 import MXFP8Tensor, MXFP8TensorStorage
from engine.tensors.quantized import QuantizedFallbackWarning, QuantizedTensor
from engine.tensors.serialization import rebuild_quantized_tensor, rebuild_storage
from engine.tensors.storage import QuantizedTensorBase

__all__ = [
    "Float8BlockwiseTensor", "Float8BlockwiseTensorStorage", "Float8Tensor", "Float8TensorStorage",
    "MXFP8Tensor", "MXFP8TensorStorage", "QuantizedFallbackWarning", "QuantizedTensor", "QuantizedTensorBase",
    "rebuild_quantized_tensor", "rebuild_storage",
]
