"""What a quantized value is: one storage type (buffers + scheme) and the torch.Tensor over it."""

from engine.tensors.quantized import QuantizedFallbackWarning, QuantizedTensor
from engine.tensors import sharding  # noqa: F401  (registers the row-slice ops FSDP2 shards with)
from engine.tensors.named import (
    Float8BlockwiseTensor, Float8BlockwiseTensorStorage, Float8RowwiseTensor, Float8RowwiseTensorStorage,
    Float8Tensor, Float8TensorStorage, IntTensorStorage, MXFP8Tensor, MXFP8TensorStorage, MXTensor, MXTensorStorage, NVFP4Tensor,
    NVFP4TensorStorage,
)
from engine.tensors.serialization import rebuild_quantized_tensor, rebuild_storage
from engine.tensors.storage import QuantizedTensorBase

__all__ = [
    "Float8BlockwiseTensor", "Float8BlockwiseTensorStorage", "Float8RowwiseTensor", "Float8RowwiseTensorStorage",
    "Float8Tensor", "Float8TensorStorage", "IntTensorStorage", "MXFP8Tensor", "MXFP8TensorStorage", "MXTensor", "MXTensorStorage",
    "NVFP4Tensor", "NVFP4TensorStorage", "QuantizedFallbackWarning", "QuantizedTensor", "QuantizedTensorBase",
    "rebuild_quantized_tensor", "rebuild_storage",
]
