"""Pure functions on tensors: the reference quantization math (reference.py), its C++ (native.py,
csrc/) and Triton (triton/) twins, the one place that picks between them (backend.py), and the
FP8 GEMM (gemm.py)."""
