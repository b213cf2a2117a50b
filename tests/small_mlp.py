"""A two-layer MLP of engine.Linear fitting a random linear map: losses per step under a recipe (None: high precision)."""

from __future__ import annotations

import torch

import engine
from engine.autocast import fp8_autocast


def train_losses(recipe, steps: int = 25) -> list[float]:
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
