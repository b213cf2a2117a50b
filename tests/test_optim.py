"""engine.optim: fp32 states give torch.optim's parameters bit for bit (single-tensor, foreach and fused paths,
over many steps with weight decay, amsgrad, maximize, nesterov); every state format, master-weight mode and
loading path works with torch's machinery (param groups, LR schedulers, grad clipping, state dicts across
formats); FP8 primary weights of every recipe take their update through an fp32 master."""

from __future__ import annotations

import io

import pytest
import torch

import checkpoint_specs as specs
import engine
from conformance.recipes import DEFAULTS
from engine import optim
from engine.optim import formats
from engine.tensors import QuantizedTensor

STEPS = 12
OPTIMIZERS = {  # engine class, torch class, settings
    "adamw": (optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "adam_wd_amsgrad": (optim.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    "adamw_maximize_amsgrad": (optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, amsgrad=True, maximize=True)),
    "sgd_nesterov": (optim.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True)),
    "sgd_dampening_maximize": (optim.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.8, dampening=0.2, maximize=True)),
    "sgd_plain": (optim.SGD, torch.optim.SGD, dict(lr=1e-2)),
}
PATHS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
COMPRESSED = [n for n in formats.NAMES if n != "fp32"]


def params(dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for shape in ((37, 130), (5,), (3, 4, 33))]


def run(opt, ps: list[torch.Tensor], steps: int = STEPS, seed: int = 1, grads_as=None) -> list[torch.Tensor]:
    """`steps` steps on random gradients (rounded through `grads_as` first, if given)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            grad = torch.randn(p.shape, generator=g)
            p.grad = (grad if grads_as is None else grad.to(grads_as)).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in ps]


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("which", OPTIMIZERS)
def test_fp32_states_are_torchs_step(which, path):
    ours, theirs, kw = OPTIMIZERS[which]
    a, b = params(), params()
    want = run(theirs(a, **kw, **PATHS[path]), a)
    got = run(ours(b, **kw, **PATHS[path]), b)
    assert bits_equal(got, want)


@pytest.mark.parametrize("state_dtype", COMPRESSED)
@pytest.mark.parametrize("which", ["adamw", "sgd_nesterov"])
def test_compressed_states_train_near_fp32(which, state_dtype):
    """A loose sanity check of every format (the per-step bound is test_optim_bounds.py's): 25 steps stay within
    10% of the fp32 trajectory's displacement (25% for E5M2), and the states have the format's dtypes."""
    ours, _, kw = OPTIMIZERS[which]
    start = params()
    rp = params()
    ref = run(ours(rp, **kw), rp)
    ps = params()
    opt = ours(ps, **kw, state_dtype=state_dtype)
    got = run(opt, ps)
    for s, r, x in zip(start, ref, got):
        moved = (r - s.detach()).norm()
        assert (x - r).norm() < (0.25 if state_dtype == "fp8_e5m2" else 0.1) * moved, state_dtype  # 2 mantissa bits
    fmt = formats.NAMES[state_dtype]
    want = {"bf16": torch.bfloat16, "int8": torch.uint8, "fp32": torch.float32}.get(fmt.kind)
    name = ours.STATES[0]
    state = opt.state[ps[0]][name]
    assert state.dtype == (want or fmt.fp8_scheme.element), (state_dtype, state.dtype)
    assert state.shape == ps[0].shape


def test_bytes_per_parameter():
    """fp32 8 B, bf16 4 B, FP8 1x128 2 x (1 + 4/128), int8 2 x (1 + 4/256), MX 2 x (1 + 1/32) per parameter."""
    want = {"fp32": 8.0, "bf16": 4.0, "bf16_sr": 4.0, "fp8": 2 * (1 + 4 / 128), "fp8_e5m2": 2 * (1 + 4 / 128),
            "fp8_e4m3": 2 * (1 + 4 / 128), "fp8_mx": 2 * (1 + 1 / 32), "int8": 2 * (1 + 4 / 256)}
    for name, per in want.items():
        p = [torch.zeros(4, 256, requires_grad=True)]
        opt = optim.AdamW(p, state_dtype=name)
        run(opt, p, steps=1)
        assert opt.state_bytes() / 1024 == per, name


def test_param_groups_with_different_settings():
    """Each group keeps its own formats and hyper-parameters: a grouped optimizer gives each group's tensors the
    bits an optimizer of that group alone gives them, from the same gradients."""
    int8_group = dict(lr=3e-3, weight_decay=0.1, state_dtype="int8")
    mixed_group = dict(lr=1e-2, weight_decay=0.0, state_dtype={"exp_avg": "bf16", "exp_avg_sq": "fp8"})
    a = params()
    grouped = optim.AdamW([{"params": a[:1], **int8_group}, {"params": a[1:], **mixed_group}], lr=1.0)
    b0, b1 = params(), params()
    alone0, alone1 = optim.AdamW(b0[:1], **int8_group), optim.AdamW(b1[1:], **mixed_group)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, q, r, gr in zip(a, b0, b1, grads):
            p.grad, q.grad, r.grad = gr, gr.clone(), gr.clone()
        grouped.step(), alone0.step(), alone1.step()
    assert grouped.state[a[0]]["exp_avg"].dtype == torch.uint8
    assert grouped.state[a[1]]["exp_avg"].dtype == torch.bfloat16
    assert bits_equal([a[0].detach()], [b0[0].detach()])
    assert bits_equal([p.detach() for p in a[1:]], [p.detach() for p in b1[1:]])


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_lr_scheduler_and_grad_clipping(state_dtype):
    """A scheduler's lr reaches the step (the same bits as the lr set by hand per step; with fp32 states, as
    torch.optim.AdamW under the same scheduler), and clipped gradients are what the step reads."""
    def train(make, by_hand: bool) -> list[torch.Tensor]:
        ps = params()
        opt = make(ps)
        sched = None if by_hand else torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        g = torch.Generator().manual_seed(3)
        for i in range(9):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) * 10
            torch.nn.utils.clip_grad_norm_(ps, 1.0)
            assert torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ps])) <= 1.0 + 1e-5
            opt.step()
            if by_hand:
                opt.param_groups[0]["lr"] = 1e-2 * 0.5 ** ((i + 1) // 3)
            else:
                sched.step()
        return [p.detach() for p in ps]

    ours = train(lambda ps: optim.AdamW(ps, lr=1e-2, state_dtype=state_dtype), by_hand=False)
    assert bits_equal(ours, train(lambda ps: optim.AdamW(ps, lr=1e-2, state_dtype=state_dtype), by_hand=True))
    if state_dtype == "fp32":
        assert bits_equal(ours, train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), by_hand=False))
    unclipped = params()
    assert not bits_equal(ours, run(optim.AdamW(unclipped, lr=1e-2, state_dtype=state_dtype), unclipped, steps=9))


def _save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("target", COMPRESSED)
def test_state_dict_across_formats(target):
    """An fp32 checkpoint (saved by torch.optim.AdamW) loads into a compressed optimizer as its states encoded,
    and back into an fp32 one as those states decoded; the same format round-trips bit for bit."""
    a = params()
    torch_opt = torch.optim.AdamW(a, lr=1e-2)
    run(torch_opt, a, steps=3)
    sd = _save_load(torch_opt.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    ours = optim.AdamW(b, lr=1e-2, state_dtype=target)
    ours.load_state_dict(sd)
    fmt = formats.NAMES[target]
    for i, p in enumerate(b):
        for name in ("exp_avg", "exp_avg_sq"):
            want = torch_opt.state[a[i]][name]
            second = name == "exp_avg_sq"
            src = want.sqrt() if fmt.stores_sqrt(second) else want
            if fmt.stochastic:
                continue  # its bits depend on the counter; the decoded value is checked below
            data, scale = formats.encode(fmt, src, signed=not second)
            assert torch.equal(ours.state[p][name].view(torch.uint8), data.view(torch.uint8)), (name, target)
        assert ours.state[p]["step"] == torch_opt.state[a[i]]["step"]
    # same format round trip: bit for bit, and the next steps agree
    c = [p.detach().clone().requires_grad_() for p in b]
    again = optim.AdamW(c, lr=1e-2, state_dtype=target)
    again.load_state_dict(_save_load(ours.state_dict()))
    assert bits_equal(run(again, c, steps=3, seed=9), run(ours, b, steps=3, seed=9))
    # and back to fp32: the decoded values
    d = [p.detach().clone().requires_grad_() for p in b]
    back = optim.AdamW(d, lr=1e-2)
    back.load_state_dict(_save_load(ours.state_dict()))
    for p, q in zip(b, d):
        value = ours.load(ours.state[p], ours.param_groups[0], "exp_avg")
        assert back.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(back.state[q]["exp_avg"], value)


@pytest.mark.parametrize("mode", ["master", "kahan", "stochastic"])
def test_bf16_weights(mode):
    """bf16 weights, updates far below half an ulp (lr 1e-4 at |w| ~ 1): the master is the fp32 trajectory bit
    for bit (the weight its bf16 rounding); Kahan's p + c follows it closely; stochastic rounding moves the
    weights as far as fp32 does on average (the projection of the displacement on fp32's is ~1), where plain
    bf16 updates (torch.optim.AdamW on bf16 parameters) stall."""
    ref = [p.detach().float().requires_grad_() for p in params(torch.bfloat16)]  # the same start
    tiny = dict(lr=1e-4, weight_decay=0.0)
    want = run(optim.AdamW(ref, **tiny), ref, steps=40, grads_as=torch.bfloat16)
    ps = params(torch.bfloat16)
    opt = optim.AdamW(ps, **tiny, weights=mode)
    got = [p.float() for p in run(opt, ps, steps=40, grads_as=torch.bfloat16)]
    start = [p.detach().float() for p in params(torch.bfloat16)]
    naive = params(torch.bfloat16)
    stalled = run(torch.optim.AdamW(naive, **tiny), naive, steps=40, grads_as=torch.bfloat16)

    def projection(x, w, s):
        return float(((x.float() - s) * (w - s)).sum() / ((w - s) ** 2).sum())

    for p, g, w, s, n in zip(ps, got, want, start, stalled):
        assert projection(n, w, s) < 0.5
        if mode == "master":
            assert torch.equal(opt.state[p]["master"], w) and torch.equal(g, w.to(torch.bfloat16).float())
        elif mode == "kahan":
            effective = g + opt.state[p]["kahan"].float()
            assert (effective - w).abs().max() <= 2 ** -14 * w.abs().max(), (effective - w).abs().max()
    if mode == "stochastic":  # over all 5k elements: the noise of one tensor of 5 is larger than its drift
        flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (got, want, start)]
        assert 0.8 < projection(*flat) < 1.2, projection(*flat)


def test_bf16_weights_refuse_modes_for_quantized():
    with pytest.raises(ValueError, match="weights"):
        optim.AdamW(params(), weights="nearest")


@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_fp8_primary_weights_take_the_master_update(case):
    """Every recipe's FP8 primary weights (fp8_model_init): the fp32 master follows the same AdamW as an fp32
    copy given the same gradients, bit for bit, and the weight holds the master requantized by its quantizer."""
    recipe = case.recipe()
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=recipe):
        model = specs.TrainModel()
    with torch.no_grad():
        copies = [(p.dequantize() if isinstance(p, QuantizedTensor) else p).float().clone().requires_grad_()
                  for p in model.parameters()]
    opt = optim.AdamW(model.parameters(), lr=1e-2, state_dtype="int8")
    shadow = optim.AdamW(copies, lr=1e-2, state_dtype="int8")
    assert any(isinstance(p, QuantizedTensor) for p in model.parameters())
    for i in range(2):
        x = torch.randn(2, 15, specs.WIDTH, generator=torch.Generator().manual_seed(i))
        with engine.fp8_autocast(recipe=recipe):
            model(x).square().mean().backward()
        for p, c in zip(model.parameters(), copies):
            c.grad = p.grad.float().clone()
        opt.step()
        shadow.step()
        opt.zero_grad(set_to_none=True)
    for p, c in zip(model.parameters(), copies):
        master = opt.state[p].get("master", p.detach())
        assert torch.equal(master, c.detach())
        if isinstance(p, QuantizedTensor):
            again = p.quantizer.quantize(c.detach())
            assert torch.equal(p.dequantize(), again.dequantize())


def test_bad_arguments_say_what_and_how():
    with pytest.raises(ValueError, match="state_dtype: expected one of"):
        optim.AdamW(params(), state_dtype="fp4")
    with pytest.raises(TypeError, match="state_dtype"):
        optim.AdamW(params(), state_dtype=8)
    with pytest.raises(ValueError, match="unknown state"):
        optim.AdamW(params(), state_dtype={"momentum_buffer": "int8"})
    with pytest.raises(ValueError, match="amsgrad"):
        optim.AdamW(params(), amsgrad=True, state_dtype="int8")
    with pytest.raises(ValueError, match="stochastic"):
        optim.StateFormat("int8", stochastic=True)


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_torch_compile_of_a_training_step(state_dtype):
    """A torch.compile'd step (forward, backward, optimizer step; the compressed step runs eagerly inside it)
    trains as the eager one: the same parameters up to the compiled forward's roundings."""
    def train(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(engine.Linear(32, 32), torch.nn.GELU(), engine.Linear(32, 8))
        opt = optim.AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        fn = torch.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            fn(torch.randn(4, 32, generator=g))
        want = torch.uint8 if state_dtype == "int8" else torch.float32
        assert opt.state[model[0].weight]["exp_avg"].dtype == want
        return [p.detach().clone() for p in model.parameters()]

    torch._dynamo.reset()
    eager, compiled = train(False), train(True)
    for e, c in zip(eager, compiled):
        assert torch.allclose(e, c, rtol=0, atol=1e-6)
    assert any(not torch.equal(e, torch.zeros_like(e)) for e in eager)


def test_bench_floor_row_runs_the_whole_linear_int8_step(monkeypatch):
    """bench optim --floor's kernel (a lower bound, benchmarks/optim_floor.c) does the whole step it claims: one
    step from zero states equals AdamW with linear int8 block codes, computed here in float64."""
    import shutil
    from pathlib import Path

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler (cc or gcc) on PATH: the floor row compiles benchmarks/optim_floor.c "
                    "(engine's developer build needs one too)")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from optim_floor import floor_row

    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(256, generator=gen), torch.randn(256, generator=gen) * 1e-3
    tiny = torch.tensor([1e-40])  # a subnormal: loading the floor's library must not switch flush-to-zero on
    row = floor_row([w], [g], "baseline")
    row.step()
    assert (tiny * 1.0).item() != 0.0
    b1, b2, lr, eps, decay = (torch.tensor(x).item() for x in (0.9, 0.999, 1e-3, 1e-8, 1 - 1e-5))  # the fp32 values
    expected, codes, scales = [], [], []
    for wb, gb in zip(w.double().split(128), g.double().split(128)):
        m, v = gb * (1 - b1), gb * gb * (1 - b2)
        ma, va = m.abs().max(), v.abs().max()
        cm, cv = torch.round(m * 127 / ma), torch.round(v * 127 / va)
        expected.append(wb * decay - lr * (cm * ma / 127) / ((cv * va / 127).sqrt() + eps))
        codes.append(torch.stack([cm, cv]))
        scales.append(torch.stack([ma, va]) / 127)
    stored = torch.stack([row.m[0], row.v[0]]).double()
    assert (stored - torch.cat(codes, dim=1)).abs().max() <= 1 and (stored == torch.cat(codes, dim=1)).float().mean() > 0.95
    torch.testing.assert_close(torch.stack([row.ms[0], row.vs[0]], dim=1).double().flatten(),
                               torch.stack(scales).flatten(), rtol=1e-6, atol=0)
    # the floor is compiled with -ffast-math: a code may land one off where m * 127 / amax is near a half (and a
    # v code of 0 against 1 changes that update by orders of magnitude: the linear code is not a real format)
    update, want = row.w[0].double() - w.double() * decay, torch.cat(expected) - w.double() * decay
    assert torch.isclose(update, want, rtol=1e-4, atol=0).float().mean() > 0.95
    assert row.state_bytes() == 2 * 256 + 2 * 2 * 4
