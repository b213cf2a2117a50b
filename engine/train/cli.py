"""`python -m engine train`: the same GPT trained in high precision (bf16 or fp32: the dtype this machine's GEMMs
are fast at) and under each recipe, side by side."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
from pathlib import Path

import torch.distributed as dist
from pydantic import ValidationError

from engine.cli_types import finite_positive, whole_number
from engine.optim import STATE_FORMATS
from engine.recipes import RecipeMap, RecipeSchedule
from engine.train.checkpoint import MOE_FLAGS, RESUME_KEYS, SHAPE_FLAGS, load_run_checkpoint, model_config_for_resume
from engine.train.data import load_corpus
from engine.train.model import GPTConfig
from engine.train.parallel import check_layout, init_from_environment, spawn_ranks, world
from engine.train.report import baseline_note, format_optim_table, format_table, write_outputs
from engine.train.run import (RUN_NAMES, RunConfig, baseline_of, default_runs, make_recipe, recipe_plan, train,
                              train_to_file)
from engine.train.speed import interleaved_step_seconds


def _recipe_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(RUN_NAMES)}; got {text!r}")
    for name in names:
        try:
            make_recipe(name)
        except (ValueError, ValidationError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


def _states_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in STATE_FORMATS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(STATE_FORMATS)}; got {text!r}")
    return names


_positive = whole_number(1)
_MIN_WIDTH = GPTConfig.model_fields["d_model"].metadata[0].ge
_MIN_SEQ_LEN = GPTConfig.model_fields["seq_len"].metadata[0].ge


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train a small GPT in high precision and under each FP8 recipe and compare",
                            description=__doc__)
    p.add_argument("--recipes", type=_recipe_list, default=None,
                   help=f"runs to make, comma separated, of {','.join(RUN_NAMES)} (default: {','.join(default_runs())}: "
                        "the high-precision baseline is bf16 where torch's bf16 GEMM is native, else fp32; the recipe runs "
                        "keep their activations in its dtype); a run may add options: nvfp4:disable_rht sets the "
                        "recipe's bool field, :last_block_bf16 keeps the last block unquantized")
    shape = "; with --resume: the checkpoint's"
    p.add_argument("--steps", type=_positive, default=500, help="optimizer steps per run (default 500)")
    p.add_argument("--d-model", type=whole_number(_MIN_WIDTH), default=None, help=f"model width (default 128{shape})")
    p.add_argument("--layers", type=_positive, default=None, help=f"transformer blocks (default 4{shape})")
    p.add_argument("--heads", type=_positive, default=None, help=f"attention heads (default 4{shape})")
    p.add_argument("--seq-len", type=whole_number(_MIN_SEQ_LEN), default=None,
                   help=f"tokens (bytes) per sequence (default 128{shape})")
    p.add_argument("--moe", type=whole_number(0), default=None, metavar="EXPERTS",
                   help=f"mixture-of-experts MLPs with this many experts (engine.moe.MoEMLP; default 0: dense{shape})")
    p.add_argument("--top-k", type=_positive, default=None,
                   help=f"with --moe: experts per token (default 2{shape})")
    p.add_argument("--batch-size", type=_positive, default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=finite_positive, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--eval-every", type=_positive, default=50, help="steps between validation passes (default 50)")
    p.add_argument("--seed", type=whole_number(0, 2**32), default=None,
                   help="seed for weights and data order (default 0; with --resume: the checkpoint's)")
    p.add_argument("--data", default=None, help="a text file or folder to train on (default: Python's stdlib sources)")
    p.add_argument("--out", default=None, help="output folder (default: runs/<timestamp>)")
    p.add_argument("--resume", default=None, metavar="CKPT", help="continue training from a checkpoint of a run")
    p.add_argument("--recipe", default=None, choices=RUN_NAMES, help="with --resume: the recipe to continue under")
    p.add_argument("--in-process", action="store_true",
                   help="run everything in this process (faster start; peak RSS is then cumulative)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(fullgraph=True) the loss (the first steps compile; tokens/s skips them)")
    p.add_argument("--speed-rounds", type=whole_number(0), default=10,
                   help="after the runs, time this many rounds of one step per run, interleaved, for the speed "
                        "column (0: the column compares the runs' own tokens/s; default 10)")
    p.add_argument("--nproc", type=_positive, default=1,
                   help="train each run on N local processes (gloo on the CPU, NCCL on GPUs) with FSDP2 and --tp; "
                        "under torchrun leave it out: the ranks come from torchrun")
    p.add_argument("--tp", type=_positive, default=1,
                   help="tensor-parallel degree inside each data-parallel group (divides the processes; default 1)")
    p.add_argument("--fp8-weights", action="store_true",
                   help="FP8 primary weights (fp8_model_init) in the recipe runs: FSDP2 all-gathers their FP8 bytes (those "
                        "it cannot cut into whole scale blocks stay whole on every rank)")
    p.add_argument("--recipe-map", default=None, metavar="JSON",
                   help="a file holding a RecipeMap's plain form (engine.recommend(...).to_plain()): the recipe runs' "
                        "layers take its picks (or a RecipeSchedule's: the map, then a late switch)")
    p.add_argument("--switch-at", type=_fraction, default=None, metavar="F",
                   help="switch the recipe runs to --switch-to for the last part of training, from step round(F x "
                        "steps) on (NVFP4 paper, appendix D; layers the map keeps in high precision stay there; the "
                        "checkpoint carries the switch, a --resume continues it)")
    p.add_argument("--switch-to", default="bf16", choices=RUN_NAMES,
                   help="with --switch-at: the recipe after the switch (bf16 or fp32: high precision; default bf16)")
    p.add_argument("--optim-states", type=_states_list, default=None, metavar="LIST",
                   help="one run per optimizer state format (comma separated, of "
                        f"{','.join(STATE_FORMATS)}) under the first of --recipes (default: the baseline), with "
                        "engine.optim.AdamW; a second table compares each with the fp32 states' run")
    p.set_defaults(run=run)


def _fraction(text: str) -> float:
    """A fraction in (0, 1] of the run's steps."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction of the run's steps in (0, 1], e.g. 0.9, got {text!r}")
    return value


#: the argparse destination of each shape flag (engine.train.checkpoint.SHAPE_FLAGS)
_SHAPE_DESTS = {"d_model": "d_model", "n_layers": "layers", "n_heads": "heads", "seq_len": "seq_len",
                "moe_experts": "moe", "moe_top_k": "top_k"}


def _model_config(args: argparse.Namespace, checkpoint: dict | None) -> GPTConfig:
    """The model's shape: from the flags (the defaults where not given), or from the checkpoint resumed."""
    given = {field: getattr(args, dest) for field, dest in _SHAPE_DESTS.items()}
    if checkpoint is not None:
        return model_config_for_resume(checkpoint, args.resume, given)
    try:
        return GPTConfig(**{field: value for field, value in given.items() if value is not None})
    except ValidationError as err:
        named = {**SHAPE_FLAGS, **MOE_FLAGS}
        flags = [named[str(e["loc"][0])] for e in err.errors() if e["loc"]] or \
            (["--top-k", "--moe"] if "moe_top_k" in str(err) else ["--d-model", "--heads"])
        raise ValueError(f"{', '.join(flags)}: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _configs(args: argparse.Namespace, out_dir: Path) -> list[RunConfig]:
    checkpoint = None
    if args.resume is not None:
        if args.recipe is None:
            raise ValueError("--resume needs --recipe: the recipe (or bf16, fp32) to continue under")
        checkpoint = load_run_checkpoint(args.resume, "--resume", RESUME_KEYS)
    elif args.recipe is not None:
        raise ValueError("--recipe goes with --resume; to choose runs use --recipes")
    model = _model_config(args, checkpoint)
    runs = [args.recipe] if args.resume is not None else (args.recipes or list(default_runs()))
    seed = args.seed
    if seed is None:  # a resumed run continues the checkpoint's data order
        seed = int(checkpoint.get("seed", 0)) if checkpoint is not None else 0
    common = {"model": model, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
              "eval_every": args.eval_every, "seed": seed, "out_dir": str(out_dir),
              "progress": not args.no_progress, "warmup_steps": min(30, args.steps // 10), "compile": args.compile,
              "tp": args.tp, "fp8_weights": args.fp8_weights, "dtype": baseline_of(runs),
              "recipe_map": _recipe_plan(args)}
    nproc = _processes(args)
    if nproc > 1:
        check_layout(nproc, args.tp, model)
        if args.batch_size % (nproc // args.tp):
            raise ValueError(f"--batch-size: must be a multiple of the data-parallel ranks ({nproc // args.tp}), "
                             f"got {args.batch_size}")
        if args.fp8_weights and args.tp > 1:
            raise ValueError("--fp8-weights: not with --tp (tensor parallel shards high-precision weights only)")
        if args.compile:
            raise ValueError("--compile: not with several processes (torch.compile of DTensor modules is refused)")
    elif args.tp > 1:
        raise ValueError(f"--tp {args.tp}: needs several processes (--nproc, or torchrun)")
    if args.resume is not None:
        return [RunConfig(recipe=args.recipe, resume=args.resume, **common)]
    if args.optim_states is not None:
        if nproc > 1:
            raise ValueError("--optim-states: one process only (engine.optim's FSDP2 path is not the demo's)")
        return [RunConfig(recipe=runs[0], optim_states=states, **common) for states in args.optim_states]
    return [RunConfig(recipe=name, **common) for name in runs]


def _recipe_plan(args: argparse.Namespace) -> dict | None:
    """The plain form of the recipe runs' map (--recipe-map), made a RecipeSchedule by --switch-at."""
    plain = None if args.recipe_map is None else json.loads(Path(args.recipe_map).read_text())
    if args.switch_at is None:
        return plain
    plan = recipe_plan(plain)
    if isinstance(plan, RecipeSchedule):
        raise ValueError(f"--switch-at: {args.recipe_map} already holds a schedule (switch_at {plan.switch_at}); "
                         "leave --switch-at out, or pass a plain map")
    schedule = RecipeSchedule(recipe_map=plan or RecipeMap(), switch_at=args.switch_at,
                              switch_to=make_recipe(args.switch_to))
    return schedule.to_plain()


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def _processes(args: argparse.Namespace) -> int:
    if _under_torchrun():
        if args.nproc > 1:
            raise ValueError("--nproc: under torchrun the processes are torchrun's (--nproc-per-node); leave it out")
        return int(os.environ.get("WORLD_SIZE", 1))
    return args.nproc


def _run_one(cfg: RunConfig, corpus, out_dir: Path, args: argparse.Namespace) -> dict:
    """One run: here (--in-process, or a rank under torchrun), on --nproc ranks, or in a fresh process."""
    if args.in_process or _under_torchrun():
        return train(cfg, corpus)
    result_path = out_dir / f"{cfg.label}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.nproc > 1:
        try:
            spawn_ranks(args.nproc, train_to_file, (cfg.model_dump_json(), corpus, str(result_path)))
        except Exception as err:  # a rank's traceback is printed above; torch.multiprocessing says which rank
            raise SystemExit(f"engine train: the {cfg.recipe} run failed on {args.nproc} processes: {err}") from None
    else:
        process = multiprocessing.get_context("spawn").Process(
            target=train_to_file, args=(cfg.model_dump_json(), corpus, str(result_path)))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"engine train: the {cfg.recipe} run failed (exit code {process.exitcode})")
    return json.loads(result_path.read_text())


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        configs = _configs(args, out_dir)
        corpus = load_corpus(args.data)
    except (ValueError, ValidationError) as err:
        raise SystemExit(f"engine train: {err}") from None
    if _under_torchrun():
        init_from_environment()
    leader = world()[0] == 0
    nproc = _processes(args)
    if leader:
        print(f"data: {corpus.source}: {len(corpus.train):,} train / {len(corpus.val):,} validation bytes")
        print(f"model: {configs[0].model.model_dump()}, {configs[0].steps} steps of "
              f"{configs[0].batch_size}x{configs[0].model.seq_len} tokens; output: {out_dir}")
        print(f"baseline: {baseline_note(configs[0].dtype)}")
        if nproc > 1:
            print(f"processes: {nproc} ({nproc // args.tp} data-parallel (FSDP2) x {args.tp} tensor-parallel)")
    results = [_run_one(cfg, corpus, out_dir, args) for cfg in configs]
    if _under_torchrun():
        dist.barrier()  # no rank tears its connections down while another still reads from them
        dist.destroy_process_group()
    if not leader:
        return 0
    optim_runs = any(c.optim_states is not None for c in configs)
    if args.speed_rounds > 0 and nproc == 1 and len(configs) > 1 and any(c.recipe == c.dtype for c in configs) \
            and not optim_runs:
        print(f"\ntiming the runs' steps interleaved ({args.speed_rounds} rounds) for the speed column")
        medians = interleaved_step_seconds(configs, corpus, args.speed_rounds)
        for result in results:
            result["interleaved_step_seconds"] = medians[result["recipe"]]
    print()
    print(format_table(results))
    if optim_runs:
        print()
        print(format_optim_table(results))
    paths = write_outputs(results, out_dir)
    print(f"\nwrote {paths['png']}, {paths['json']}, {paths['csv']} and a checkpoint per run "
          f"(resume with --resume {results[0]['checkpoint']} --recipe <name>)")
    return 0
