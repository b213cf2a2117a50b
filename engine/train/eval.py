"""`python -m engine eval CKPT`: validation loss and perplexity of a demo GPT checkpoint under each inference config.

The checkpoint is one `python -m engine train` wrote (runs/<t>/bf16.pt). Each config gets a fresh model
with the checkpoint's weights, `quantize_`d, evaluated on the same validation windows as training
(`engine.train.run.evaluate`). Every linear weight is quantized: the QKV LayerNormLinear, the
attention projection (engine.Linear), the LayerNormMLP's fc1 and fc2 and the output head
(torch.nn.Linear); the embeddings and norms stay in high precision.
"""

from __future__ import annotations

import argparse
import math
import warnings
from typing import Any

from engine.cli_types import whole_number
from engine.inference.configs import (
    Float8DynamicActivationFloat8Weight, Float8WeightOnly, InferenceConfig, Int4WeightOnly,
    Int8DynamicActivationInt8Weight, Int8WeightOnly, MXWeightOnly, NVFP4WeightOnly,
)
from engine.inference.quantize import linear_weight_bytes, quantize_

EVAL_CONFIGS: dict[str, InferenceConfig] = {
    "int8wo": Int8WeightOnly(), "int4wo-g128": Int4WeightOnly(group_size=128), "int4wo-g32": Int4WeightOnly(group_size=32),
    "int8dq": Int8DynamicActivationInt8Weight(), "fp8wo": Float8WeightOnly(),
    "fp8dq-tensor": Float8DynamicActivationFloat8Weight("tensor"), "fp8dq-row": Float8DynamicActivationFloat8Weight("row"),
    "mx-e4m3": MXWeightOnly("e4m3"), "mx-e3m2": MXWeightOnly("e3m2"), "mx-e2m3": MXWeightOnly("e2m3"),
    "mx-e2m1": MXWeightOnly("e2m1"), "nvfp4": NVFP4WeightOnly(),
}


def _config_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in EVAL_CONFIGS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {','.join(EVAL_CONFIGS)}; got {text!r}")
    return names


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", help="validation loss / perplexity of a demo GPT checkpoint under each "
                                         "inference quantization config", description=__doc__)
    p.add_argument("checkpoint", help="a checkpoint of `python -m engine train` (runs/<t>/bf16.pt)")
    p.add_argument("--configs", type=_config_list, default=list(EVAL_CONFIGS),
                   help=f"comma separated, of {','.join(EVAL_CONFIGS)} (default: all)")
    p.add_argument("--data", default=None, help="the text file or folder the run trained on (default: stdlib sources)")
    p.add_argument("--eval-batches", type=whole_number(1), default=8,
                   help="validation windows (default 8, as training)")
    p.add_argument("--batch-size", type=whole_number(1), default=16, help="sequences per window (default 16)")
    p.add_argument("--seed", type=whole_number(0, 2**32), default=None,
                   help="validation seed (default: the checkpoint's)")
    p.set_defaults(run=run)


def evaluate_checkpoint(checkpoint: dict[str, Any], corpus: Any, names: list[str], *, eval_batches: int = 8,
                        batch_size: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """[{"config", "val_loss", "perplexity", "linear_weight_bytes"}] for bf16 (no quantization) and each name
    (weight bytes: bf16 at 2 bytes per element, or the quantized parts)."""
    from engine.train.model import GPT, GPTConfig
    from engine.train.run import RunConfig, evaluate

    model_config = GPTConfig(**checkpoint["model_config"])
    cfg = RunConfig(model=model_config, eval_batches=eval_batches, batch_size=batch_size, seed=seed, progress=False)
    rows = []
    for name in ["bf16", *names]:
        model = GPT(model_config)
        model.load_state_dict(checkpoint["model"])
        model.eval()
        if name != "bf16":
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="engine: NVFP4 quantization")
                quantize_(model, EVAL_CONFIGS[name])
        loss = evaluate(model.loss, corpus, cfg, None)
        rows.append({"config": name, "val_loss": loss, "perplexity": math.exp(loss),
                     "linear_weight_bytes": linear_weight_bytes(model)})
    return rows


def run(args: argparse.Namespace) -> int:
    from engine.train.checkpoint import load_run_checkpoint
    from engine.train.data import load_corpus

    try:
        checkpoint = load_run_checkpoint(args.checkpoint, "checkpoint", ("model", "model_config"))
    except ValueError as err:
        raise SystemExit(f"engine eval: {err}") from None
    corpus = load_corpus(args.data)
    seed = checkpoint.get("seed", 0) if args.seed is None else args.seed
    rows = evaluate_checkpoint(checkpoint, corpus, args.configs, eval_batches=args.eval_batches,
                               batch_size=args.batch_size, seed=seed)
    base = rows[0]["val_loss"]
    print(f"{args.checkpoint}: validation on {corpus.source} ({args.eval_batches} windows of {args.batch_size}); "
          "quantized: every linear weight (QKV, attention projection, MLP fc1/fc2, output head)")
    print("| config | val loss | gap vs bf16 | perplexity | Linear weight KiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / base - 1):+.2f}% | "
              f"{r['perplexity']:.3f} | {r['linear_weight_bytes'] / 1024:.0f} |")
    return 0
