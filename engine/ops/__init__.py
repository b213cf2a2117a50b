"""Pure functions on tensors: the reference (plain PyTorch) quantization math."""
