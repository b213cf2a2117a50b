"""The command line refuses bad numbers before any work, names the flag, and every usage line names the command."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from engine.cli import BENCHMARKS, build_parser, main
from engine.train.run import RunConfig


@pytest.mark.parametrize("flag, value, expected", [
    ("--lr", "inf", "a finite number > 0"), ("--lr", "-inf", "a finite number > 0"),
    ("--lr", "nan", "a finite number > 0"), ("--lr", "1e999", "a finite number > 0"),
    ("--lr", "0", "a finite number > 0"), ("--lr", "-1e-3", "a finite number > 0"), ("--lr", "fast", "a finite number > 0"),
    ("--speed-rounds", "-3", "a whole number >= 0"), ("--speed-rounds", "1.5", "a whole number >= 0"),
    ("--steps", "0", "a whole number >= 1"), ("--steps", "-5", "a whole number >= 1"),
    ("--batch-size", "0", "a whole number >= 1"), ("--eval-every", "-1", "a whole number >= 1"),
    ("--d-model", "4", "a whole number >= 8"), ("--d-model", "-128", "a whole number >= 8"),
    ("--layers", "0", "a whole number >= 1"), ("--heads", "0", "a whole number >= 1"),
    ("--seq-len", "1", "a whole number >= 2"), ("--nproc", "0", "a whole number >= 1"),
    ("--tp", "-2", "a whole number >= 1"),
    ("--seed", "-1", "a whole number >= 0 and < 4294967296"), ("--seed", str(2**32), "a whole number >= 0 and < 4294967296"),
])
def test_train_refuses_bad_numbers_naming_the_flag(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["train", f"{flag}={value}"])  # "=": argparse takes "-inf" for an option
    assert raised.value.code == 2
    assert f"engine train: error: argument {flag}: expected {expected}, got {value!r}" in capsys.readouterr().err


def test_train_takes_the_edges_of_each_range():
    args = build_parser().parse_args(["train", "--lr", "1e-30", "--speed-rounds", "0", "--seed", str(2**32 - 1),
                                      "--d-model", "8", "--seq-len", "2", "--steps", "1"])
    assert (args.lr, args.speed_rounds, args.seed, args.d_model, args.seq_len, args.steps) == \
        (1e-30, 0, 2**32 - 1, 8, 2, 1)


def test_run_config_refuses_a_non_finite_learning_rate_and_a_seed_out_of_range():
    for lr in (math.inf, math.nan, 0.0):
        with pytest.raises(ValidationError, match="lr"):
            RunConfig(lr=lr)
    with pytest.raises(ValidationError, match="seed"):
        RunConfig(seed=-1)


def test_a_width_the_heads_do_not_divide_names_both_flags(tmp_path):
    with pytest.raises(SystemExit) as raised:
        main(["train", "--d-model", "30", "--heads", "4", "--out", str(tmp_path), "--in-process"])
    assert str(raised.value) == "engine train: --d-model, --heads: d_model (30) must be a multiple of n_heads (4)"


@pytest.mark.parametrize("content, message", [
    (None, "engine eval: checkpoint: no checkpoint at "),
    (b"\x00garbage", "engine eval: checkpoint: cannot load "),
    ({"model": {}}, "is not a checkpoint of `python -m engine train` (no 'model_config' key)"),
])
def test_eval_of_a_missing_or_foreign_file_says_so(tmp_path, content, message):
    path = tmp_path / "x.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(SystemExit) as raised:
        main(["eval", str(path)])
    assert isinstance(raised.value.code, str) and message in raised.value.code


def test_eval_refuses_bad_numbers(capsys):
    for flag in ("--eval-batches", "--batch-size"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["eval", "x.pt", flag, "0"])
        assert f"argument {flag}: expected a whole number >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmarks_usage_names_the_command(name, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", name, "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: engine bench {name} [-h]" in out and "__main__" not in out


@pytest.mark.parametrize("command", ["train", "eval", "generate", "formats", "info", "bench"])
def test_every_commands_usage_names_the_command(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: engine {command} ")
