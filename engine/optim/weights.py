"""How a parameter that is not fp32 takes its update: the fp32 value the step works on, and the write back.

* `master` (default for bf16 / fp16 and quantized `fp8_model_init` weights): an fp32 master copy in the state
  (`master`); the parameter is its copy (bf16 nearest even) or its requantization (`QuantizedTensor.quantize_`).
* `kahan` (bf16 weights): a bf16 compensation (`kahan`) holds what the last rounding lost; the step works on
  `p + c`, and writes `p = bf16(w)`, `c = bf16(w - p)`: about 16 significant bits for 2 extra bytes.
* `stochastic` (bf16 weights): `p = round_bf16_stochastic(w)`, unbiased to 1/256 ulp, no extra state.
fp32 parameters are updated in place whatever the mode.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.ops.nvfp4_sr import advance, random_bits
from engine.optim.formats import round_bf16_stochastic
from engine.optim.sharded import GLOBAL_NUMEL
from engine.tensors.quantized import QuantizedTensor

WeightMode = Literal["master", "kahan", "stochastic"]
WEIGHT_MODES = ("master", "kahan", "stochastic")


def check_mode(mode: object) -> str:
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights: expected one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    return str(mode)


def in_place(p: torch.Tensor) -> bool:
    """An fp32 plain parameter: the step updates it directly."""
    return p.dtype == torch.float32 and not isinstance(p, QuantizedTensor)


def value_of(p: torch.Tensor) -> torch.Tensor:
    """The parameter's fp32 value (dequantized for a quantized weight)."""
    return p.dequantize().float() if isinstance(p, QuantizedTensor) else p.detach().float()


def init_state(p: torch.Tensor, mode: str, state: dict, seed: int) -> None:
    if in_place(p):
        return
    if isinstance(p, QuantizedTensor) and mode != "master":
        raise ValueError(f"weights: a quantized (fp8_model_init) weight needs weights='master', got {mode!r}")
    if mode == "master":
        state["master"] = value_of(p).clone()
    elif p.dtype != torch.bfloat16:
        raise ValueError(f"weights: {mode!r} is for bf16 weights, got {p.dtype}; use weights='master'")
    elif mode == "kahan":
        state["kahan"] = torch.zeros_like(p, dtype=torch.bfloat16)
    else:
        state["sr_counter"] = torch.tensor([seed, 0], dtype=torch.int64)


def working_value(p: torch.Tensor, state: dict) -> torch.Tensor:
    """The fp32 tensor the step updates: p itself, the master, or p (+ its Kahan compensation) in fp32."""
    if in_place(p):
        return p.data if isinstance(p, torch.nn.Parameter) else p
    if "master" in state:
        return state["master"]
    w = p.detach().float()
    return w + state["kahan"].float() if "kahan" in state else w


def write_back(p: torch.Tensor, w: torch.Tensor, state: dict) -> None:
    """Store the updated fp32 value `w` into the parameter as its mode says."""
    if in_place(p):
        return
    with torch.no_grad():
        if isinstance(p, QuantizedTensor):
            p.quantize_(w)
        elif "kahan" in state:
            rounded = w.to(torch.bfloat16)
            state["kahan"].copy_((w - rounded.float()).to(torch.bfloat16))
            p.copy_(rounded)
        elif "sr_counter" in state:
            counter = state["sr_counter"]
            p.copy_(round_bf16_stochastic(w, random_bits(tuple(w.shape), counter)))
            advance(counter, state.get(GLOBAL_NUMEL, w.numel()))  # a shard: the whole tensor's count
        else:
            p.copy_(w)
