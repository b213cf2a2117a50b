"""engine.optim: Adam, AdamW and SGD (momentum) with fp32, bf16, FP8 or 8-bit optimizer states, and fp32
master, Kahan-compensated or stochastically rounded updates of low-precision weights (docs/optim.md)."""

from engine.optim.adam import Adam, AdamW
from engine.optim.formats import NAMES as STATE_FORMATS
from engine.optim.formats import StateFormat
from engine.optim.sgd import SGD

__all__ = ["SGD", "STATE_FORMATS", "Adam", "AdamW", "StateFormat"]
