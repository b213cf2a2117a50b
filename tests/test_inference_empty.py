"""engine.quantize_ on layers with no input features (torch.nn.Linear(0, N)) or no outputs: the weight
quantizes to an empty one, the layer gives torch's output (for K = 0 the bias on every row: an empty sum),
and it saves and loads."""

from __future__ import annotations

import io

import pytest
import torch

import engine
from engine.inference.weight import QuantizedWeight
from test_inference import ALL_CONFIGS, ids

pytestmark = [pytest.mark.filterwarnings("ignore:engine. NVFP4 quantization"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]


def _round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
@pytest.mark.parametrize("k, n", [(0, 8), (0, 0), (8, 0)])
def test_an_empty_linear_quantizes_runs_and_reloads(config, k, n):
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n).bfloat16()
    torch.nn.init.uniform_(layer.bias)  # torch leaves a fan-in-0 bias as it was allocated
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    want = layer(x)  # torch's: the bias on every row
    engine.quantize_(layer, config)
    assert isinstance(layer.weight, QuantizedWeight) and layer.weight.shape == (n, k)
    assert layer.weight.dequantize().shape == (n, k)
    got = layer(x)
    assert got.shape == (2, 3, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    target = engine.quantize_(torch.nn.Linear(k, n).bfloat16(), config)
    target.load_state_dict(_round_trip(layer.state_dict()))
    assert torch.equal(target(x), want)
