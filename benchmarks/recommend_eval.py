"""Where a 4-bit run's validation-loss gap comes from: its final checkpoint evaluated again with the forward in
high precision. The demo's validation runs the forward under the run's recipe, so a 4-bit run's validation loss
holds both what training in 4-bit did to the weights and the 4-bit forward's own error at validation.

    PYTHONPATH=. python benchmarks/recommend_eval.py ROOT/s0/nvfp4 [--recipe nvfp4]

reads the run's checkpoint (its per-layer map comes with it) and results.json, and writes ROOT/s0/nvfp4/eval.json:
the validation loss (the run's 8 held-out batches) with the forward in bf16 and under the run's recipe (the latter
is the run's own final validation loss, as a check). `--recipe R` evaluates a bf16 run's weights under R instead.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.train.data import load_corpus
from engine.train.model import GPT, GPTConfig
from engine.train.run import LAST_BLOCK_BF16, RunConfig, activation_dtype, evaluate, make_recipe, split_run_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run's output folder (its results.json and checkpoint)")
    p.add_argument("--recipe", default=None, help="evaluate under this recipe (default: the run's)")
    args = p.parse_args()
    run = Path(args.run)
    checkpoint = torch.load(next(run.glob("*.pt")), weights_only=True)
    name = checkpoint["recipe"]
    cfg = RunConfig(seed=checkpoint["seed"], model=GPTConfig(**checkpoint["model_config"]))
    model = GPT(cfg.model, high_precision_last_blocks=int(LAST_BLOCK_BF16 in split_run_name(name)[1]),
                activation_dtype=activation_dtype(RunConfig(recipe=name)))
    model.load_state_dict(checkpoint["model"])  # the per-layer picks come with it
    corpus = load_corpus()
    recipe = args.recipe or name
    out = {"run": name, "val_loss_bf16_forward": evaluate(model.loss, corpus, cfg, None),
           "recipe": recipe, "val_loss_recipe_forward": evaluate(model.loss, corpus, cfg, make_recipe(recipe))}
    if args.recipe is None:
        (run / "eval.json").write_text(json.dumps(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
