"""The demo's speed column: the runs' training steps timed interleaved, in one process.

Each run trains in its own process, one after another, so its tokens/s also measures the
machine's load during those minutes, which drifts on a shared machine. The speed ratios
come instead from a short phase after the runs: every run's model takes one step in turn
(run 1, run 2, ..., run 1, ...) for a few rounds, and each run's median step time is
divided into the baseline's. Load then falls on all runs alike.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.train.data import Corpus, batch_at
from engine.train.run import RunConfig, build_model, make_recipe, train_step


def interleaved_step_seconds(configs: list[RunConfig], corpus: Corpus, rounds: int,
                             warmup: int = 2) -> dict[str, float]:
    """Median seconds per training step of each run (by run name), the runs' steps interleaved.

    The models start from the seed's initial weights (step time does not depend on the values)
    and train on the runs' first batches.
    """
    steppers = []
    for cfg in configs:
        recipe = make_recipe(cfg.recipe)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, recipe)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = batch_at(corpus.train, 0, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
        loss_fn = torch.compile(model.loss, fullgraph=True) if cfg.compile else model.loss
        steppers.append((cfg.recipe, model, optimizer, loss_fn, recipe, tokens))
    times: dict[str, list[float]] = {name: [] for name, *_ in steppers}
    for round_ in range(warmup + rounds):
        for name, model, optimizer, loss_fn, recipe, tokens in steppers:
            began = time.perf_counter()
            train_step(model, optimizer, loss_fn, recipe, tokens)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}
