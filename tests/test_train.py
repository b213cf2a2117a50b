"""`python -m engine train` end to end on a tiny model: every recipe, files, table, resume."""

import csv
import json
import subprocess
import sys

import pytest
import torch

import engine

from engine.cli import main
from engine.train.data import batch_at, load_corpus
from engine.train.report import COLUMNS
from engine.train.run import default_runs

DEFAULT_RUNS = default_runs()  # the machine's baseline (bf16 or fp32), then the FP8 recipes

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--eval-every", "10", "--in-process", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--steps", "20", "--out", str(out), *TINY]) == 0
    return out


def test_every_recipe_trains_and_the_outputs_are_written(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    assert [r["recipe"] for r in results] == list(DEFAULT_RUNS)
    for r in results:
        assert len(r["train_losses"]) == 20 and [s for s, _ in r["val_losses"]] == [10, 20]
        first, last = sum(r["train_losses"][:3]) / 3, r["final_train_loss"]
        assert last < first - 0.5, (r["recipe"], first, last)  # from ~5.5 nats (uniform bytes) down
        assert r["tokens_per_second"] > 0 and r["peak_rss_bytes"] > 0 and r["saved_activation_bytes"] > 0
        assert (tiny_run / f"{r['recipe']}.pt").is_file()
    with (tiny_run / "results.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == COLUMNS and [row[0] for row in rows[1:]] == list(DEFAULT_RUNS)
    assert rows[1][3] == "+0.00" and rows[1][5] == "1.00"  # the baseline against itself
    png = (tiny_run / "losses.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_speed_column_comes_from_the_interleaved_step_times(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    base = results[0]["interleaved_step_seconds"]
    with (tiny_run / "results.csv").open() as f:
        speeds = [row[5] for row in list(csv.reader(f))[1:]]
    assert all(r["interleaved_step_seconds"] > 0 for r in results)
    assert speeds == [f"{base / r['interleaved_step_seconds']:.2f}" for r in results]


def test_without_speed_rounds_the_speed_column_compares_tokens_per_second(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--recipes", "bf16,current", "--speed-rounds", "0", "--out", str(out),
                 *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    assert all("interleaved_step_seconds" not in r for r in results)
    with (out / "results.csv").open() as f:
        speed = list(csv.reader(f))[2][5]
    assert speed == f"{results[1]['tokens_per_second'] / results[0]['tokens_per_second']:.2f}"


def test_fp8_runs_save_fewer_activation_bytes_than_the_baseline(tiny_run):
    results = {r["recipe"]: r for r in json.loads((tiny_run / "results.json").read_text())}
    for name in DEFAULT_RUNS[1:]:
        assert results[name]["saved_activation_bytes"] < results[DEFAULT_RUNS[0]]["saved_activation_bytes"]


def test_the_baseline_is_the_dtype_the_machine_is_fast_at(tiny_run):
    """bf16 where torch's bf16 GEMM is native, fp32 elsewhere; the recipe runs keep its activations."""
    from engine.ops.exact_gemm import native_bf16_gemm

    results = json.loads((tiny_run / "results.json").read_text())
    baseline = "bf16" if native_bf16_gemm() else "fp32"
    assert results[0]["recipe"] == baseline and {r["dtype"] for r in results} == {baseline}


def test_recipe_runs_keep_the_baseline_dtype():
    from engine.train.model import GPTConfig
    from engine.train.run import RunConfig, build_model, make_recipe

    model = GPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8)
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for name in (dtype, "delayed"):
            cfg = RunConfig(recipe=name, dtype=dtype, model=model)
            gpt = build_model(cfg, make_recipe(name))
            seen = []
            gpt.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
            with engine.fp8_autocast(enabled=name != dtype, recipe=make_recipe(name)):
                gpt(torch.zeros(2, 8, dtype=torch.long))
            assert seen == [torch_dtype], (dtype, name)
    with pytest.raises(TypeError, match="activation_dtype"):
        from engine.train.model import GPT
        GPT(model, activation_dtype=torch.float16)


@pytest.mark.parametrize("source, target", [("delayed", "mxfp8"), ("bf16", "current"), ("block", "bf16")])
def test_resume_continues_a_run_under_another_recipe(tiny_run, tmp_path, source, target):
    out = tmp_path / "resumed"
    with pytest.warns(UserWarning, match="loaded under") if source == "delayed" else _no_warning():
        assert main(["train", "--steps", "5", "--resume", str(tiny_run / f"{source}.pt"), "--recipe", target,
                     "--out", str(out), *TINY]) == 0
    (result,) = json.loads((out / "results.json").read_text())
    assert result["recipe"] == target and result["steps"] == [21, 25]
    before = json.loads((tiny_run / "results.json").read_text())
    source_loss = next(r for r in before if r["recipe"] == source)["final_train_loss"]
    assert result["final_train_loss"] < source_loss + 0.3  # it continued, it did not start over (~5.5)
    assert torch.load(out / f"{target}.pt", weights_only=True)["step"] == 25


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("argv, message", [
    (["--recipes", "fp4"], "expected one of"),
    (["--recipes", "nvfp4:bogus"], "'bogus' is not an option of nvfp4"),
    (["--recipes", "bf16:last_block_bf16"], "the bf16 run takes no recipe options"),
    (["--steps", "0"], "expected a whole number >= 1"),
    (["--recipe", "mxfp8"], "--recipe goes with --resume"),
    (["--resume", "/nonexistent.pt", "--recipe", "bf16"], "no checkpoint"),
    (["--d-model", "30", "--heads", "4"], "multiple of n_heads"),
    (["--data", "/nonexistent/path"], "neither a file nor a folder"),
])
def test_bad_options_get_a_clear_message(argv, message):
    proc = subprocess.run([sys.executable, "-m", "engine", "train", *argv, "--steps", "1", "--in-process"]
                          if "--steps" not in argv else [sys.executable, "-m", "engine", "train", *argv],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and message in proc.stderr


def test_custom_data_and_deterministic_batches(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    corpus = load_corpus(str(text))
    assert len(corpus.train) + len(corpus.val) == len(text.read_bytes())
    a = batch_at(corpus.train, 3, batch_size=2, seq_len=16, seed=0)
    assert torch.equal(a, batch_at(corpus.train, 3, batch_size=2, seq_len=16, seed=0))
    assert not torch.equal(a, batch_at(corpus.train, 4, batch_size=2, seq_len=16, seed=0))
    assert a.shape == (2, 17) and a.dtype == torch.int64


def test_help_lists_the_options():
    out = subprocess.run([sys.executable, "-m", "engine", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for option in ("--recipes", "--steps", "--d-model", "--layers", "--seq-len", "--batch-size", "--seed", "--data",
                   "--out", "--resume", "--recipe"):
        assert option in out


def test_compile_trains_the_same_losses_as_eager(tmp_path, monkeypatch):
    """--compile runs torch.compile(model.loss, fullgraph=True); aot_eager here (Inductor takes minutes):
    with the same seed and batches the losses match eager's."""
    import functools

    import engine.train.run as run

    monkeypatch.setattr(run.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    results = {}
    for flag in ([], ["--compile"]):
        out = tmp_path / ("compiled" if flag else "eager")
        assert main(["train", "--steps", "4", "--recipes", "delayed", "--out", str(out), *TINY, *flag]) == 0
        results[bool(flag)] = json.loads((out / "results.json").read_text())[0]["train_losses"]
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=0)


def test_run_options_set_recipe_fields_and_keep_the_last_block_in_bf16():
    from engine.recipes import NVFP4BlockScaling
    from engine.train.model import GPT, GPTConfig
    from engine.train.run import make_recipe

    assert make_recipe("nvfp4:disable_rht:disable_stochastic_rounding") == NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True)
    assert make_recipe("mxfp8:last_block_bf16") == make_recipe("mxfp8")  # a model option, not a recipe field
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=3, n_heads=2, seq_len=8), high_precision_last_blocks=1)
    tokens = torch.randint(0, 256, (2, 8))
    with engine.fp8_autocast(recipe=make_recipe("mxfp8")):
        model(tokens).sum().backward()
    ran_fp8 = [[m._recipe is not None for m in block.modules() if isinstance(m, engine.Linear | engine.LayerNormLinear
                                                                            | engine.LayerNormMLP)]
               for block in model.blocks]
    assert ran_fp8 == [[True] * 3, [True] * 3, [False] * 3]
