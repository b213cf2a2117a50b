"""`python -m engine <command>` (also installed as the `engine` console script)."""

from __future__ import annotations

import argparse
import sys

from engine.formats import format_table


def _formats(args: argparse.Namespace) -> int:
    print(format_table())
    return 0


def _info(args: argparse.Namespace) -> int:
    from engine.machine import format_info as format_device_info

    print(format_device_info())
    return 0


BENCHMARKS = {"quantize": "bench_quantize", "gemm": "bench_gemm", "linear": "bench_linear",
              "compile": "bench_compile", "mx": "bench_mx_small", "nvfp4": "bench_nvfp4", "inference": "bench_inference",
              "moe": "bench_moe", "optim": "bench_optim"}


def _bench(args: argparse.Namespace) -> int:
    """Run the scripts of benchmarks/ (they live in the source checkout, next to engine/)."""
    import importlib
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if not folder.is_dir():
        raise SystemExit(f"engine bench: no benchmarks/ folder at {folder}; run it from a source checkout")
    sys.path.insert(0, str(folder))
    for name in args.which:
        print(f"== {name}")
        importlib.import_module(BENCHMARKS[name]).main(args.extra, prog=f"{args.bench_prog} {name}")
        print()
    return 0


def _bench_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in BENCHMARKS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(BENCHMARKS)}; got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="FP8 and MX low-precision training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formats = commands.add_parser("formats", help="print the table of number formats (bits, bias, range)")
    formats.set_defaults(run=_formats)
    info = commands.add_parser("info", help="print the GPU / NVML status, the CPU and its kernels, and where and "
                                            "how each recipe runs here")
    info.set_defaults(run=_info)
    bench = commands.add_parser("bench", help="print benchmark tables (quantize GB/s, GEMM GFLOP/s, Linear step)")
    quick = [name for name in BENCHMARKS if name not in ("compile", "mx", "nvfp4", "inference", "moe")]  # minutes; by name
    bench.add_argument("which", nargs="?", type=_bench_list, default=quick,
                       help=f"benchmarks to run, comma separated, of {','.join(BENCHMARKS)} (default: {','.join(quick)})")
    bench.add_argument("extra", nargs=argparse.REMAINDER,
                       help="options passed to each benchmark script, e.g. `linear --shapes 16x256x256`")
    bench.set_defaults(run=_bench, bench_prog=bench.prog)  # each script's usage: `engine bench linear ...`
    from engine.train.cli import add_parser as add_train_parser

    add_train_parser(commands)
    from engine.train.eval import add_parser as add_eval_parser

    add_eval_parser(commands)
    from engine.train.generate import add_parser as add_generate_parser

    add_generate_parser(commands)
    from engine.train.inspection import add_parser as add_inspect_parser

    add_inspect_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
