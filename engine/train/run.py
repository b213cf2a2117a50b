"""One training run of the demo GPT under one recipe (or in high precision), with its measurements.

Every run with the same seed sees the same initial weights and the same batches in the
same order, so runs differ only in how their GEMMs are quantized. The high-precision baseline
is the dtype the machine's GEMMs are fast at (`baseline_name`): bf16 where torch's bf16 GEMM runs
on bf16 instructions (or on a GPU), fp32 elsewhere (a CPU without AVX512-BF16 / AMX, where torch's
bf16 matmul converts to fp32 inside, several times slower). The recipe runs keep their activations
in the baseline's dtype (`RunConfig.dtype`); parameters are fp32 master weights in every run.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
)
from tqdm import tqdm

import engine
from engine import optim as engine_optim
from engine.ops.exact_gemm import native_bf16_gemm
from engine.modules.recipe_maps import four_bit_flop_share
from engine.recipes import RECIPES, Recipe, RecipeMap, RecipeSchedule
from engine.train.checkpoint import RESUME_KEYS, load_run_checkpoint, saved_model_config
from engine.train.data import Corpus, batch_at
from engine.train.model import GPT, GPTConfig
from engine.train.parallel import clip_grad_norm_, full_state_dict, mean_over_ranks, parallelize, world

#: the high-precision runs and their activations' dtype
HIGH_PRECISION = {"bf16": torch.bfloat16, "fp32": torch.float32}
RUN_NAMES = (*HIGH_PRECISION, *RECIPES)
#: the recipes `python -m engine train` runs by default after the baseline (MXFP4/MXFP6 runs are reached with
#: --recipes)
DEFAULT_RECIPES = ("delayed", "current", "block", "mxfp8")


def baseline_name() -> str:
    """The high-precision run the machine is fast at: "bf16" where torch's bf16 GEMM is native (a GPU, or a CPU
    with AVX512-BF16 / AMX: `engine.ops.exact_gemm.native_bf16_gemm`), else "fp32"."""
    return "bf16" if torch.cuda.is_available() or native_bf16_gemm() else "fp32"


def default_runs() -> tuple[str, ...]:
    """What `python -m engine train` runs by default: the baseline, then DEFAULT_RECIPES."""
    return (baseline_name(), *DEFAULT_RECIPES)


def baseline_of(names: list[str]) -> str:
    """The baseline among a list of runs: the one high-precision run listed, else the machine's (`baseline_name`)."""
    listed = [n for n in names if n in HIGH_PRECISION]
    return listed[0] if len(listed) == 1 else baseline_name()


class RunConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    recipe: str = "bf16"
    dtype: str = Field("bf16", pattern="^(bf16|fp32)$")  # activations of the recipe runs: the baseline's
    model: GPTConfig = GPTConfig()
    steps: int = Field(500, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(2e-3, gt=0, allow_inf_nan=False)
    warmup_steps: int = Field(30, ge=0)
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(8, ge=1)
    seed: int = Field(0, ge=0, lt=2**32)  # batch_at makes generator seeds of seed * 1_000_003 + step
    out_dir: str = "runs/latest"
    resume: str | None = None
    progress: bool = True
    compile: bool = False  # torch.compile(model.loss, fullgraph=True)
    tp: int = Field(1, ge=1)  # tensor-parallel degree when several processes train (engine.train.parallel)
    fp8_weights: bool = False  # FP8 primary weights (fp8_model_init) for the recipe runs
    #: a RecipeMap's plain form (e.g. engine.recommend's) for the recipe runs' layers, or a RecipeSchedule's (the
    #: map, then a late switch to higher precision); a resumed run without one continues its checkpoint's schedule
    recipe_map: dict | None = None
    optim_states: str | None = None  # engine.optim.AdamW's state_dtype (None: torch.optim.AdamW)

    @property
    def label(self) -> str:
        """The run's name in tables and file names: the recipe, and its optimizer states where chosen."""
        return self.recipe if self.optim_states is None else f"{self.recipe}+{self.optim_states}-states"


#: a run option that keeps the last transformer block in bf16 (TE's advice for 4-bit training)
LAST_BLOCK_BF16 = "last_block_bf16"
#: run options that set non-bool recipe fields: NVFP4 "4over6" on the weights (TE's usual choice), or on weights
#: and activations (which takes the inputs without the RHT, as TE requires)
FIELD_OPTIONS = {"4over6": {"nvfp4_4over6": "weights"}, "4over6_all": {"nvfp4_4over6": "all", "disable_rht": True}}


def split_run_name(name: str) -> tuple[str, list[str]]:
    """A run name is `recipe[:option...]`: `nvfp4:disable_rht` sets the recipe's bool field `disable_rht`;
    `:last_block_bf16` runs the last block in bf16."""
    base, *options = name.split(":")
    return base, options


def make_recipe(name: str) -> Recipe | None:
    """None for a high-precision run (bf16, fp32), else the named recipe with its defaults and the run's bool
    options set."""
    base, options = split_run_name(name)
    if base not in RUN_NAMES:
        raise ValueError(f"recipe: expected one of {list(RUN_NAMES)} (optionally followed by :options), got {name!r}")
    fields = [o for o in options if o != LAST_BLOCK_BF16]
    if base in HIGH_PRECISION:
        if options:
            raise ValueError(f"recipe: the {base} run takes no recipe options, got {name!r}")
        return None
    model_fields = RECIPES[base].model_fields
    known = {f for f, info in model_fields.items() if info.annotation is bool}
    known |= {o for o, sets in FIELD_OPTIONS.items() if set(sets) <= set(model_fields)}
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise ValueError(f"recipe: {unknown[0]!r} is not an option of {base}; its options are "
                         f"{sorted(known) + [LAST_BLOCK_BF16]}, got {name!r}")
    settings = {}
    for f in fields:
        settings.update(FIELD_OPTIONS.get(f, {f: True}))
    return RECIPES[base](**settings)


def learning_rate(cfg: RunConfig, step: int, total: int) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def evaluate(loss_fn: Callable[[torch.Tensor], torch.Tensor], corpus: Corpus, cfg: RunConfig,
             recipe: Recipe | None) -> float:
    """Mean loss over fixed validation windows (the same for every run)."""
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            tokens = batch_at(corpus.val, i, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed + 1)
            with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
                losses.append(loss_fn(tokens).item())
    return sum(losses) / len(losses)


def saved_activation_bytes(model: GPT, tokens: torch.Tensor, recipe: Recipe | None) -> int:
    """Bytes of the distinct tensors autograd keeps for backward over one forward pass."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = model.loss(tokens)
    loss.backward()  # keep delayed-scaling bookkeeping consistent
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The demo's AdamW (betas 0.9, 0.95, weight decay 0.1): torch's, or engine.optim's with `cfg.optim_states`
    (its fused native step where the kernel takes the states)."""
    if cfg.optim_states is None:
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return engine_optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
                              state_dtype=cfg.optim_states, fused=True)


def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> float:
    """Every optimizer state byte (moments, block scales, masters) per parameter; step counters excluded."""
    total = sum(t.numel() * t.element_size() for state in optimizer.state.values() for k, t in state.items()
                if isinstance(t, torch.Tensor) and k not in ("step", "state_counter", "sr_counter"))
    return total / sum(p.numel() for p in model.parameters())


def train_step(model: GPT, optimizer: torch.optim.Optimizer, loss_fn: Callable[[torch.Tensor], torch.Tensor],
               recipe: Recipe | None, tokens: torch.Tensor) -> torch.Tensor:
    """One optimizer step as the demo takes it (forward in fp8_autocast, backward after it); returns the loss."""
    with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        loss = loss_fn(tokens)
    loss.backward()
    clip_grad_norm_(list(model.parameters()), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def activation_dtype(cfg: RunConfig) -> torch.dtype:
    """A high-precision run's own dtype; a recipe run's is the baseline's (cfg.dtype)."""
    base = split_run_name(cfg.recipe)[0]
    return HIGH_PRECISION[base if base in HIGH_PRECISION else cfg.dtype]


def recipe_plan(plain: dict | None) -> RecipeMap | RecipeSchedule | None:
    """A run's per-layer plan from its plain form: a RecipeSchedule's (it has `switch_at`) or a RecipeMap's."""
    if plain is None:
        return None
    return RecipeSchedule.from_plain(plain) if "switch_at" in plain else RecipeMap.from_plain(plain)


def build_model(cfg: RunConfig, recipe: Recipe | None) -> GPT:
    """The run's GPT, with FP8 primary weights if asked, the last block in high precision if the run name says
    so, and the per-layer map if given (a schedule's map before its switch)."""
    with engine.fp8_model_init(enabled=cfg.fp8_weights and recipe is not None, recipe=recipe):
        model = GPT(cfg.model, high_precision_last_blocks=int(LAST_BLOCK_BF16 in split_run_name(cfg.recipe)[1]),
                    activation_dtype=activation_dtype(cfg))
    plan = recipe_plan(cfg.recipe_map) if recipe is not None else None
    if plan is not None:
        engine.set_recipe_map(model, plan.recipe_map if isinstance(plan, RecipeSchedule) else plan)
    return model


def four_bit_share(model: GPT, recipe: Recipe | None) -> float:
    """The share of the model's engine GEMM FLOPs in 4-bit under `recipe` and the modules' picks now."""
    first_bf16 = len(model.blocks) - model.high_precision_last_blocks
    return four_bit_flop_share(model, recipe, tuple(f"blocks.{i}" for i in range(first_bf16, len(model.blocks))))


def late_switch(cfg: RunConfig, recipe: Recipe | None, checkpoint: dict | None,
                end: int) -> tuple[RecipeSchedule | None, int]:
    """The run's schedule and its switch step (0-based, counted from the first run's step 0): the config's (its
    fraction of `end` steps), else a resumed checkpoint's (the step it saved)."""
    plan = recipe_plan(cfg.recipe_map) if recipe is not None else None
    if isinstance(plan, RecipeSchedule):
        return plan, plan.switch_step(end)
    if plan is None and recipe is not None and checkpoint is not None and "recipe_schedule" in checkpoint:
        return RecipeSchedule.from_plain(checkpoint["recipe_schedule"]), int(checkpoint["switch_step"])
    return None, end


def describe_replicated(run: str, replicated: dict[str, str]) -> str:
    """What `parallelize` kept out of FSDP2, one line per reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in replicated.items():
        by_reason.setdefault(reason, []).append(name)
    lines = [f"{run}: {len(replicated)} FP8 weights are kept whole on every rank, their gradients averaged, as FSDP2 "
             "cannot shard them:"]
    return "\n".join(lines + [f"  {reason}: {', '.join(names)}" for reason, names in by_reason.items()])


def train(cfg: RunConfig, corpus: Corpus) -> dict[str, Any]:
    """Train, evaluate, checkpoint; returns the run's numbers as plain data.

    In a process group (`engine.train.parallel`) every rank calls this; the model is sharded over the
    ranks, each takes its slice of the global batch, and the numbers are the global batch's.
    """
    recipe = make_recipe(cfg.recipe)
    torch.manual_seed(cfg.seed)
    rank, ranks = world()
    model = build_model(cfg, recipe)
    start, checkpoint = 0, None
    if cfg.resume is not None:
        checkpoint = load_run_checkpoint(cfg.resume, "resume", RESUME_KEYS)
        saved = saved_model_config(checkpoint, cfg.resume)
        if saved is not None and saved != cfg.model:
            raise ValueError(f"resume: {cfg.resume} holds a model {saved.model_dump()}, not {cfg.model.model_dump()}")
        model.load_state_dict(checkpoint["model"])
        start = int(checkpoint["step"])
    end = start + cfg.steps
    schedule, switch_step = late_switch(cfg, recipe, checkpoint, end)
    dp_rank, dp_size, replicated = parallelize(model, cfg.tp)
    if replicated and rank == 0:
        print(describe_replicated(cfg.recipe, replicated), flush=True)
    if cfg.batch_size % dp_size:
        raise ValueError(f"--batch-size: must be a multiple of the data-parallel ranks ({dp_size}), got {cfg.batch_size}")
    optimizer = make_optimizer(model, cfg)
    if checkpoint is not None:
        set_optimizer_state_dict(model, optimizer, checkpoint["optimizer"], options=StateDictOptions(full_state_dict=True))
    loss_fn = torch.compile(model.loss, fullgraph=True) if cfg.compile else model.loss
    tokens_per_step = cfg.batch_size * cfg.model.seq_len
    train_losses, val_losses, step_times = [], [], []
    share, four_bit_steps = four_bit_share(model, recipe), 0.0
    bar = tqdm(range(start, end), desc=f"{cfg.recipe:>7}", disable=not cfg.progress or rank > 0, dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step, end)
        tokens = batch_at(corpus.train, step, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
        tokens = tokens.chunk(dp_size)[dp_rank]
        if schedule is not None and step == max(switch_step, start):  # the late switch (a resumed run: at once)
            engine.set_recipe_map(model, schedule.late_map())
            share = four_bit_share(model, recipe)
        four_bit_steps += share
        began = time.perf_counter()
        loss = train_step(model, optimizer, loss_fn, recipe, tokens)
        step_times.append(time.perf_counter() - began)
        train_losses.append(mean_over_ranks(loss).item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == end:
            val_losses.append((step + 1, evaluate(loss_fn, corpus, cfg, recipe)))
        timed = step_times[min(3, len(step_times) - 1):]
        bar.set_postfix(loss=f"{train_losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(timed) / sum(timed):.0f}")
    bar.close()
    timed = step_times[min(3, len(step_times) - 1):]  # the first steps build states and warm caches
    probe = batch_at(corpus.train, 0, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
    probe = probe.chunk(dp_size)[dp_rank]
    out_dir = Path(cfg.out_dir)
    checkpoint_path = out_dir / f"{cfg.label.replace(':', '-')}.pt"
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # unsharded, as one process holds it
    state = {"model": full_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=full)}
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        carried = {} if schedule is None else {"recipe_schedule": schedule.to_plain(), "switch_step": switch_step}
        torch.save({**state, "step": end, "model_config": cfg.model.model_dump(), "recipe": cfg.recipe,
                    "seed": cfg.seed, **carried}, checkpoint_path)
    last = train_losses[-min(10, len(train_losses)):]
    return {
        "recipe": cfg.label,
        "optim_states": cfg.optim_states or "fp32 (torch)",
        "optimizer_bytes_per_param": optimizer_bytes_per_param(optimizer, model),
        "dtype": cfg.dtype,
        "resumed_from": cfg.resume,
        "steps": [start + 1, end],
        "train_losses": train_losses,
        "val_losses": val_losses,
        "final_train_loss": sum(last) / len(last),
        "final_val_loss": val_losses[-1][1],
        "four_bit_flop_share": four_bit_steps / cfg.steps,  # of the engine layers' GEMM FLOPs, over this run's steps
        "switch_step": None if schedule is None else switch_step,
        "tokens_per_second": tokens_per_step * len(timed) / sum(timed),  # of all ranks together
        "ranks": ranks,
        "tensor_parallel": cfg.tp if ranks > 1 else 1,
        "peak_rss_bytes": peak_rss_bytes(),
        "saved_activation_bytes": saved_activation_bytes(model, probe, recipe),
        "checkpoint": str(checkpoint_path),
    }


def train_to_file(cfg_json: str, corpus: Corpus, result_path: str) -> None:
    """Entry point of a run in its own process (its peak RSS is its own), or of each rank of a group (rank 0
    writes the result)."""
    result = train(RunConfig.model_validate_json(cfg_json), corpus)
    if world()[0] == 0:
        Path(result_path).write_text(json.dumps(result))
