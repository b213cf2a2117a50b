"""`python -m engine inspect --recipe R [--what-if R2] [--checkpoint CKPT]`: engine.inspect on the demo GPT.

Trains the demo model (a checkpoint of `python -m engine train`, or a fresh one) for a few steps under the
recipe R with the inspector on every `--every`-th step, and writes `records.jsonl`, `records.csv` and the
plots (SQNR heatmap, amax / scale traces, GEMM error per layer) to `--out`; prints, per layer, the worst
numbers of the last inspected step. `--recipe bf16` runs in high precision (then only `--what-if` is measured).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from engine.cli_types import whole_number


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("inspect", help="per-layer numerics (SQNR, underflow, saturation, GEMM error) of the "
                                            "demo GPT under a recipe, with plots", description=__doc__)
    p.add_argument("--recipe", required=True, help="the recipe to train with: a run name of `engine train` "
                                                   "(bf16, delayed, mxfp8, nvfp4, ...)")
    p.add_argument("--what-if", default=None, help="another recipe to measure on the same operands")
    p.add_argument("--checkpoint", default=None, help="a checkpoint of `python -m engine train` (default: a fresh "
                                                      "model of the default shape)")
    p.add_argument("--steps", type=whole_number(1), default=20, help="training steps (default 20)")
    p.add_argument("--every", type=whole_number(1), default=5, help="inspect every N-th step (default 5)")
    p.add_argument("--batch-size", type=whole_number(1), default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (default 2e-4)")
    p.add_argument("--data", default=None, help="a text file or folder (default: the stdlib sources)")
    p.add_argument("--seed", type=whole_number(0, 2**32), default=0, help="batch seed (default 0)")
    p.add_argument("--out", default="runs/inspect", help="where the records and plots go (default runs/inspect)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def summary(records: list[dict[str, Any]]) -> list[str]:
    """A markdown table: per layer and source, the last inspected step's lowest operand SQNR, highest underflow and
    saturation, each GEMM's relative error and the gradient-to-noise ratio."""
    last = max(r["step"] for r in records)
    rows = ["| layer | source | min SQNR dB | max underflow % | max saturation % | fprop err | dgrad err | "
            "wgrad err | grad/noise |", "|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["layer"], r["source"]) for r in records if r["step"] == last))
    for layer, source in keys:
        mine = [r for r in records if r["step"] == last and r["layer"] == layer and r["source"] == source]
        ops = [r for r in mine if r["kind"] == "operand"]
        gemm = {r["gemm"]: r for r in mine if r["kind"] == "gemm"}
        cell = lambda v, f: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)  # noqa: E731
        ratio = gemm.get("wgrad", {}).get("grad_noise_ratio")
        flag = " (< sqrt 3)" if ratio is not None and ratio < math.sqrt(3) else ""
        rows.append(f"| {layer} | {source} | {cell(min((r['sqnr_db'] for r in ops), default=None), '.1f')} | "
                    f"{cell(max((r['underflow_pct'] for r in ops), default=None), '.2f')} | "
                    f"{cell(max((r['saturation_pct'] for r in ops), default=None), '.2f')} | "
                    + " | ".join(cell(gemm.get(g, {}).get("rel_error"), ".4f") for g in ("fprop", "dgrad", "wgrad"))
                    + f" | {cell(ratio, '.1f')}{flag} |")
    return rows


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import engine
    from engine.numerics.plots import write_plots
    from engine.train.checkpoint import load_run_checkpoint
    from engine.train.data import batch_at, load_corpus
    from engine.train.model import GPT, GPTConfig
    from engine.train.run import HIGH_PRECISION, make_recipe, split_run_name, train_step

    try:
        recipe = make_recipe(args.recipe)
        what_if = None if args.what_if is None else make_recipe(args.what_if)
        if recipe is None and what_if is None:
            raise ValueError("--recipe is high precision and no --what-if is given: nothing to measure")
        checkpoint = None if args.checkpoint is None else load_run_checkpoint(args.checkpoint, "--checkpoint",
                                                                              ("model", "model_config"))
        corpus = load_corpus(args.data)
    except ValueError as err:
        raise SystemExit(f"engine inspect: {err}") from None
    base = split_run_name(args.recipe)[0]
    config = GPTConfig(**checkpoint["model_config"]) if checkpoint is not None else GPTConfig()
    torch.manual_seed(args.seed)
    model = GPT(config, activation_dtype=HIGH_PRECISION.get(base, torch.bfloat16))
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    out = Path(args.out)
    with engine.inspect(model, every=args.every, out=out, what_if=what_if) as inspector:
        for step in tqdm(range(args.steps), desc=f"inspect {args.recipe}", disable=args.no_progress,
                         dynamic_ncols=True):
            tokens = batch_at(corpus.train, step, batch_size=args.batch_size, seq_len=config.seq_len, seed=args.seed)
            train_step(model, optimizer, model.loss, recipe, tokens)
    paths = write_plots(inspector.records, out)
    print("\n".join(summary(inspector.records)))
    print(f"wrote {out / 'records.jsonl'}, {out / 'records.csv'} and {', '.join(p.name for p in paths)}")
    return 0
