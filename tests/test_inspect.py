"""engine.inspect on models: every registered recipe, what-if, every=N, the files, and no effect on training."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import engine
from engine import autocast
from engine.recipes import RECIPES, DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
from engine.recipes.operands import operand_key

LAYERS = ("0", "2.fc1", "2.fc2")


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(engine.Linear(64, 64), torch.nn.GELU(), engine.LayerNormMLP(64, 128))


def run(model: torch.nn.Module, recipe: object, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """`steps` training steps (forward, backward, SGD); returns every output and gradient, in order."""
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        x = torch.randn(2, 16, 64, generator=gen, requires_grad=True)
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        out.pow(2).mean().backward()
        seen += [out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return seen


def expected_operands(recipe: object) -> set[str]:
    return {operand_key(op) for op, spec in recipe.operands().items() if spec is not None}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_registered_recipe_records_every_operand_and_gemm(name: str) -> None:
    recipe = RECIPES[name]()
    model = make_model()
    with engine.inspect(model, what_if=recipe) as inspector:
        run(model, recipe, 1)
    records = inspector.records
    for layer in LAYERS:
        for source in ("train", "what_if"):
            mine = [r for r in records if r["layer"] == layer and r["source"] == source]
            assert {r["operand"] for r in mine if r["kind"] == "operand"} == expected_operands(recipe)
            assert {r["gemm"] for r in mine if r["kind"] == "gemm"} == {"fprop", "dgrad", "wgrad"}
            for r in mine:
                assert r["recipe"] == name
                if r["kind"] == "operand":
                    assert r["sqnr_db"] > 5 and 0 <= r["underflow_pct"] < 50 and r["mse"] >= 0
                    assert r["scale_min"] <= r["scale_max"]
                else:
                    assert 0 < r["rel_error"] < 0.5
        # the what-if recipe is the training one: the forward quantizes alike (backward may round stochastically)
        fprop = {r["source"]: r["rel_error"] for r in records if r["layer"] == layer and r.get("gemm") == "fprop"}
        assert fprop["train"] == fprop["what_if"]


def test_wgrad_reports_the_gradient_to_noise_ratio() -> None:
    model = make_model()
    with engine.inspect(model) as inspector:
        run(model, MXFP8BlockScaling(), 1)
    wgrads = [r for r in inspector.records if r.get("gemm") == "wgrad"]
    assert len(wgrads) == len(LAYERS)
    for r in wgrads:
        assert r["grad_noise_ratio"] == pytest.approx(1 / r["rel_error"])
        assert r["below_threshold"] == (r["grad_noise_ratio"] < math.sqrt(3))


def test_what_if_in_a_high_precision_run() -> None:
    model = make_model()
    with engine.inspect(model, what_if=NVFP4BlockScaling()) as inspector:
        run(model, None, 1)
    assert inspector.records and {r["source"] for r in inspector.records} == {"what_if"}
    assert {r["gemm"] for r in inspector.records if r["kind"] == "gemm"} == {"fprop", "dgrad", "wgrad"}


@pytest.mark.parametrize("recipe", [DelayedScaling(), NVFP4BlockScaling()], ids=["delayed", "nvfp4"])
def test_outputs_and_grads_are_bit_identical_with_the_inspector(recipe: object) -> None:
    """Off (skipped steps) and on (inspected steps, with a what-if recipe): the training bits do not change -
    delayed scaling's history and NVFP4's stochastic-rounding counters included."""
    plain = run(make_model(), recipe, 4)
    model = make_model()
    with engine.inspect(model, every=2, what_if=type(recipe)()):
        watched = run(model, recipe, 4)
    assert len(plain) == len(watched)
    for a, b in zip(plain, watched):
        assert torch.equal(a, b)


def test_every_n_skips_steps_with_the_observer_unset() -> None:
    model = make_model()
    armed = []
    model[0].register_forward_pre_hook(lambda m, a: armed.append(autocast.inspector() is not None))
    with engine.inspect(model, every=3) as inspector:
        run(model, DelayedScaling(), 7)
    assert armed == [True, False, False, True, False, False, True]
    assert sorted({r["step"] for r in inspector.records}) == [0, 3, 6]
    assert autocast.inspector() is None  # and not after the context


def test_writes_json_lines_and_csv(tmp_path) -> None:
    model = make_model()
    with engine.inspect(model, every=2, out=tmp_path / "insp") as inspector:
        run(model, MXFP8BlockScaling(), 3)
    lines = [json.loads(line) for line in (tmp_path / "insp" / "records.jsonl").read_text().splitlines()]
    assert len(lines) == len(inspector.records) and {r["step"] for r in lines} == {0, 2}
    with (tmp_path / "insp" / "records.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines)
    assert [float(r["sqnr_db"]) for r in rows if r["kind"] == "operand"] == \
        [r["sqnr_db"] for r in lines if r["kind"] == "operand"]


def test_refuses_a_compiled_model() -> None:
    model = torch.compile(make_model())
    with pytest.raises(RuntimeError, match="the model is compiled with torch.compile"):
        with engine.inspect(model):
            pass


def test_a_model_compiled_inside_the_context_is_refused_when_records_are_written() -> None:
    model = make_model()
    with pytest.raises(RuntimeError, match="compiled inside the context"):
        with engine.inspect(model):
            with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
                torch.compile(model)(torch.randn(16, 64))


@pytest.mark.parametrize("kwargs, field", [({"every": 0}, "every"), ({"every": True}, "every"),
                                           ({"what_if": "nvfp4"}, "what_if"), ({"out": 3}, "out")])
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        with engine.inspect(make_model(), **kwargs):
            pass


def test_activation_recompute_records_each_gemm_once() -> None:
    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.mlp = engine.Linear(64, 64), engine.LayerNormMLP(64, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return engine.checkpoint(self.mlp, self.first(x))

    torch.manual_seed(0)
    model = Checkpointed()
    with engine.inspect(model) as inspector:
        x = torch.randn(32, 64, requires_grad=True)
        with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
            y = model(x)
        y.sum().backward()
    for layer in ("first", "mlp.fc1", "mlp.fc2"):
        gemms = sorted(r["gemm"] for r in inspector.records if r["layer"] == layer and r["kind"] == "gemm")
        assert gemms == ["dgrad", "fprop", "wgrad"], layer
        operands = [r["operand"] for r in inspector.records if r["layer"] == layer and r["kind"] == "operand"]
        assert sorted(operands) == sorted(set(operands)) and len(operands) == 6, layer


def test_layers_of_another_model_run_unwatched() -> None:
    model, other = make_model(), make_model(seed=3)
    with engine.inspect(model) as inspector:
        run(model, MXFP8BlockScaling(), 1)
        run(other, MXFP8BlockScaling(), 1)  # after an inspected step, before the next: the observer is set
    assert {r["layer"] for r in inspector.records} == set(LAYERS) and {r["step"] for r in inspector.records} == {0}
    assert len(inspector.records) == len(LAYERS) * (6 + 3)  # six operand usages and three GEMMs per layer


def test_cli_inspect_writes_records_plots_and_a_table(tmp_path, capsys) -> None:
    from engine.cli import main

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)  # 10 KiB: enough windows of the demo's 128 bytes
    out = tmp_path / "out"
    assert main(["inspect", "--recipe", "mxfp8", "--what-if", "nvfp4", "--steps", "2", "--every", "2",
                 "--batch-size", "1", "--data", str(text), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| blocks.0.attn.qkv | train |" in printed and "| blocks.3.mlp.fc2 | what_if |" in printed
    lines = (out / "records.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == {0}
    for name in ("sqnr_heatmap.png", "scale_traces.png", "gemm_error.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_inspect_refuses_nothing_to_measure(tmp_path) -> None:
    from engine.cli import main

    text = tmp_path / "text.txt"
    text.write_text("x" * 4096)
    with pytest.raises(SystemExit, match="nothing to measure"):
        main(["inspect", "--recipe", "bf16", "--data", str(text), "--no-progress"])


def test_fp8_primary_weights_and_fused_wgrad_run_under_the_inspector() -> None:
    """A weight the call does not quantize (FP8 primary) has no operand record; a wgrad fused into main_grad has
    no GEMM record; the rest is recorded."""
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=MXFP8BlockScaling()):
        primary = engine.Linear(64, 64)
    fused = engine.Linear(64, 64, fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros(64, 64)
    model = torch.nn.Sequential(primary, fused)
    with engine.inspect(model) as inspector:
        x = torch.randn(32, 64, requires_grad=True)
        with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
            model(x).sum().backward()
    ops = {(r["layer"], r["operand"]) for r in inspector.records if r["kind"] == "operand"}
    gemms = {(r["layer"], r["gemm"]) for r in inspector.records if r["kind"] == "gemm"}
    assert ("0", "fprop_weight") not in ops and ("0", "fprop_input") in ops and ("1", "fprop_weight") in ops
    assert gemms == {("0", "fprop"), ("0", "dgrad"), ("0", "wgrad"), ("1", "fprop"), ("1", "dgrad")}
