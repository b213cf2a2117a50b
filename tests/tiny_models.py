"""Small models and helpers the recipe and checkpoint tests share: a block of all three engine modules, an MLP
training loop, a few training steps, a torch.save round trip (weights_only) and a fixed next output."""

from __future__ import annotations

import io

import torch

import engine
from engine.autocast import fp8_autocast


class TinyModel(torch.nn.Module):
    """LayerNormLinear -> Linear -> LayerNormMLP (SwiGLU) with a residual: every engine module, tiny."""

    def __init__(self):
        super().__init__()
        self.qkv = engine.LayerNormLinear(64, 96)
        self.proj = engine.Linear(96, 64)
        self.mlp = engine.LayerNormMLP(64, 128, activation="swiglu")

    def forward(self, x):
        return self.mlp(self.proj(self.qkv(x)) + x)


def train_losses(recipe, steps: int = 25) -> list[float]:
    """A two-layer MLP of engine.Linear fitting a random linear map: the loss per step (recipe None: high precision)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(engine.Linear(64, 96), torch.nn.GELU(), engine.Linear(96, 32))
    target = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        with torch.no_grad():
            y = target(x)
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(model, recipe, steps, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.randn(2, 32, 64)
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def next_output(model, recipe):
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(99))
    with fp8_autocast(recipe=recipe):
        return model(x)
