"""Plain tensors in, plain tensors out: the reference math (reference.py), its C++ (native.py, csrc/)
and Triton (triton/) twins, the registry that picks a kernel per op, layout and device
(registry.py, backend.py), and the custom ops the layers above call (quantize.py)."""
