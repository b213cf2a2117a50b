"""engine.recommend on the demo GPT (`python -m engine train`'s model): writes the map for `--recipe-map`.

    python benchmarks/recommend_demo.py --d-model 64 --seq-len 64 --batch-size 8 --out map.json \
        [--checkpoint runs/x/bf16.pt] [--batches 2] [--budget 0.2] [--threshold 0.1] [--candidates nvfp4] \
        [--statistic loss|grad] [--switch-at 0.9 [--switch-to bf16]]

The model is the one a run of the same shape and seed starts from (or a run's checkpoint); the batches are the
run's first training batches. Prints the table recommend decided from and the share of GEMM FLOPs per pick.
With --switch-at the file holds a RecipeSchedule (the map, then the late switch), which `--recipe-map` takes too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import engine
from engine.recipes import RECIPES
from engine.train.data import batch_at, load_corpus
from engine.train.model import GPT, GPTConfig
from engine.train.run import RunConfig, activation_dtype, make_recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="a run's checkpoint to measure (default: the initial model)")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--candidates", default="nvfp4", help="comma-separated recipe names, lowest precision first")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--threshold", type=float, default=0.1)
    p.add_argument("--statistic", default="gemm", choices=("gemm", "loss", "grad"),
                   help="gemm: the largest relative GEMM error; loss: the loss change, one layer quantized at a time; "
                        "grad: the gradient error, one GEMM of one layer quantized at a time (picks per GEMM)")
    p.add_argument("--switch-at", type=float, default=None, help="a late switch at this fraction of the steps")
    p.add_argument("--switch-to", default="bf16", help="the recipe after the switch (bf16: high precision)")
    p.add_argument("--out", required=True, help="where to write the map (JSON)")
    args = p.parse_args()
    cfg = RunConfig(model=GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                                    seq_len=args.seq_len), batch_size=args.batch_size, seed=args.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model, activation_dtype=activation_dtype(cfg))
    if args.checkpoint is not None:
        model.load_state_dict(torch.load(args.checkpoint, weights_only=True)["model"])
    corpus = load_corpus()
    batches = [batch_at(corpus.train, step, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
               for step in range(args.batches)]
    candidates = [RECIPES[name]() for name in args.candidates.split(",")]
    recipe_map = engine.recommend(model, batches, candidates=candidates, budget=args.budget,
                                  threshold=args.threshold, loss_fn=lambda m, tokens: m.loss(tokens),
                                  switch_at=args.switch_at, switch_to=make_recipe(args.switch_to),
                                  statistic=args.statistic)
    Path(args.out).write_text(json.dumps(recipe_map.to_plain(), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
