"""`python -m engine <command>` (also installed as the `engine` console script)."""

from __future__ import annotations

import argparse
import sys

from engine.formats import format_table


def _formats(args: argparse.Namespace) -> int:
    print(format_table())
    return 0


def _info(args: argparse.Namespace) -> int:
    from engine.device import format_device_info

    print(format_device_info())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="FP8 and MX low-precision training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formats = commands.add_parser("formats", help="print the table of number formats (bits, bias, range)")
    formats.set_defaults(run=_formats)
    info = commands.add_parser("info", help="print the GPU / NVML status and which FP8 recipes can run")
    info.set_defaults(run=_info)
    from engine.train.cli import add_parser as add_train_parser

    add_train_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
