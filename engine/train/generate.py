"""`python -m engine generate`: text from a demo GPT checkpoint under inference configs, with prefill and decode speed.

The checkpoint is one `python -m engine train` wrote (runs/<t>/bf16.pt). The model's blocks are cast
to bf16 (the values training's GEMMs read; the head stays fp32, as trained), then, unless `bf16`,
every linear weight is quantized (`engine.quantize_`: QKV, attention projection, MLP fc1/fc2, head).
The prompt is read in one forward (prefill) that fills a KV cache; each further token is one forward of
one position (decode). Greedy by default; `--temperature` (with `--top-k`) samples with `--seed`.
The model learned seq_len positions: prompt + new tokens beyond that are refused (no sliding window).
With several configs (`--quantize all` or a comma list) every config and bf16 generate in the same
run, interleaved, and one table gives decode and prefill tokens/s against bf16 and the weight bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from engine.train.eval import EVAL_CONFIGS
from engine.inference.quantize import linear_weight_bytes, quantize_

BASELINE = "bf16"
NAMES = (BASELINE, *EVAL_CONFIGS)


@dataclass(frozen=True)
class Generation:
    """The new tokens and how long the prefill (prompt -> first new token) and the decode steps took."""

    tokens: list[int]
    prompt_length: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_length / self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after the first (each one decode forward) per second; nan with a single new token."""
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps else float("nan")


def load_model(checkpoint: dict[str, Any], name: str) -> torch.nn.Module:
    """The checkpoint's GPT in eval mode: blocks in bf16, head fp32, every linear weight quantized under the
    config `name` (one of EVAL_CONFIGS) unless it is "bf16"."""
    from engine.train.model import GPT, GPTConfig

    model = GPT(GPTConfig(**checkpoint["model_config"]))
    model.load_state_dict(checkpoint["model"])
    model.blocks.to(torch.bfloat16)
    model.eval()
    if name != BASELINE:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="engine: NVFP4 quantization")
            quantize_(model, EVAL_CONFIGS[name])
    return model


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """[batch, 1] tokens from the last position's [batch, vocab] logits: argmax at temperature 0, otherwise a
    sample of softmax(logits / temperature) over the top_k most likely tokens (all if None)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> Generation:
    """`max_new_tokens` tokens after `prompt` ([batch, P] int64); batch 1 for the returned token list.
    Without `use_cache` every step recomputes the whole sequence (the reference the cache must equal)."""
    from engine.train.model import KVCache

    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    cache = KVCache(model.cfg) if use_cache else None
    new: list[torch.Tensor] = []
    with torch.inference_mode():
        began = time.perf_counter()
        token = next_token(model(prompt, cache)[:, -1], temperature, top_k, generator)
        new.append(token)
        prefilled = time.perf_counter()
        sequence = prompt
        for _ in range(max_new_tokens - 1):
            if cache is not None:
                logits = model(token, cache)[:, -1]
            else:
                sequence = torch.cat([sequence, token], dim=1)
                logits = model(sequence)[:, -1]
            token = next_token(logits, temperature, top_k, generator)
            new.append(token)
        done = time.perf_counter()
    return Generation(torch.cat(new, dim=1)[0].tolist(), prompt.shape[1], prefilled - began, done - prefilled)


def encode(text: str) -> torch.Tensor:
    """[1, bytes] int64: the demo GPT reads UTF-8 bytes."""
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- the command
def _names(text: str) -> list[str]:
    names = list(NAMES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected all, or a comma-separated list of {','.join(NAMES)}; got {text!r}")
    return list(dict.fromkeys(names))


def _positive(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0: greedy), got {text!r}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate text from a demo GPT checkpoint (KV cache) under inference "
                                             "configs; prefill and decode tokens/s", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint of `python -m engine train` (runs/<t>/bf16.pt)")
    p.add_argument("--quantize", type=_names, default=[BASELINE],
                   help=f"a config, `all`, or a comma-separated list of {','.join(NAMES)} (default: bf16); "
                        "several print a table against bf16")
    p.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="bytes to generate (default 64)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-k", type=_positive, default=None, help="sample among the k most likely bytes")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="generations per config, interleaved; speeds are their medians (default 3)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine")
    p.set_defaults(run=run)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"engine generate: {message}")


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = torch.load(args.checkpoint, weights_only=True)
    except (OSError, RuntimeError) as err:
        raise _fail(f"--checkpoint: cannot load {args.checkpoint}: {err}") from None
    if not isinstance(checkpoint, dict) or not {"model", "model_config"} <= set(checkpoint):
        raise _fail(f"--checkpoint: {args.checkpoint} is not a checkpoint of `python -m engine train` "
                    "(expected the keys 'model' and 'model_config')")
    if args.top_k is not None and args.temperature == 0:
        raise _fail("--top-k: only with --temperature > 0 (temperature 0 is greedy)")
    prompt = encode(args.prompt)
    seq_len = int(checkpoint["model_config"].get("seq_len", 128))
    if prompt.shape[1] == 0:
        raise _fail("--prompt: expected at least one byte of text")
    if prompt.shape[1] + args.max_new_tokens - 1 > seq_len:
        raise _fail(f"--max-new-tokens: the prompt ({prompt.shape[1]} bytes) and {args.max_new_tokens} new tokens need "
                    f"{prompt.shape[1] + args.max_new_tokens - 1} positions; the model learned {seq_len} (no sliding "
                    "window): shorten the prompt or generate fewer tokens")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = args.quantize if len(args.quantize) == 1 else [BASELINE, *[n for n in args.quantize if n != BASELINE]]
    models = {name: load_model(checkpoint, name) for name in names}
    for model in models.values():  # untimed: the first forward of each shape builds the kernels' primitives
        generate(model, prompt, min(2, args.max_new_tokens))
    runs: dict[str, list[Generation]] = {name: [] for name in names}
    for _ in range(args.repeats):  # interleaved: each config sees the machine in the same states
        for name, model in models.items():
            runs[name].append(generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                                       top_k=args.top_k, seed=args.seed))
    speed = {name: (statistics.median(g.decode_tokens_per_second for g in gens),
                    statistics.median(g.prefill_tokens_per_second for g in gens)) for name, gens in runs.items()}
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-k {args.top_k}, seed {args.seed}"
    if len(names) == 1:
        name = names[0]
        print(f"{args.checkpoint} ({name}, {how}):")
        print(args.prompt + decode(runs[name][0].tokens))
        decoded = (f"decode {speed[name][0]:.1f} tokens/s ({args.max_new_tokens - 1} tokens)" if args.max_new_tokens > 1
                   else "no decode step (one new token)")
        print(f"prefill {speed[name][1]:.0f} tokens/s ({prompt.shape[1]} tokens), {decoded}; median of {args.repeats}")
        return 0
    base = runs[BASELINE][0].tokens
    print(f"{args.checkpoint}: {args.max_new_tokens} new tokens after a {prompt.shape[1]}-byte prompt, {how}, batch 1; "
          f"medians of {args.repeats} interleaved runs; {torch.get_num_threads()} threads; weights: every linear layer")
    print(f"bf16 text: {args.prompt + decode(base)!r}")
    print("| config | decode tok/s | vs bf16 | prefill tok/s | vs bf16 | linear weight KiB | tokens = bf16's |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        tokens = runs[name][0].tokens
        same = next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b), len(base))
        decoded = (f"{speed[name][0]:.1f} | {speed[name][0] / speed[BASELINE][0]:.2f}x" if args.max_new_tokens > 1
                   else "- | -")
        print(f"| {name} | {decoded} | {speed[name][1]:.0f} | {speed[name][1] / speed[BASELINE][1]:.2f}x | "
              f"{linear_weight_bytes(models[name]) / 1024:.0f} | {same}/{len(base)} |")
    return 0
