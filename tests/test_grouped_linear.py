"""engine.GroupedLinear / StackedGroupedLinear against a list of per-expert engine.Linear modules, bit for bit.

Every recipe `engine.recipes` exports (and each option variant: tests/conformance/recipes.py's CASES) runs the
grouped module and E separate engine.Linear modules holding the same weights, two training steps each (delayed
scaling's second step reads the scales its first recorded, per expert), and every output and gradient must be
equal with atol=0 - for m_splits with zero-token experts, one-token experts and all tokens on one expert.
Stochastic rounding's streams are per module and GEMM index, so each reference Linear is given its expert's
counters before the first step. Then: checkpoints, fp8_model_init, recompute, compile, a RecipeMap's pick, bad input.
"""

from __future__ import annotations

import pytest
import torch

import engine
from conformance.recipes import CASES, DEFAULTS, Case
from engine.recipes import OPERANDS, DelayedScaling, MXFP8BlockScaling, RecipeMap

E, K, N = 4, 64, 32
SPLITS = {"zero_and_one": [0, 1, 29, 3], "all_on_one": [0, 0, 33, 0], "one_each": [1, 1, 1, 1]}
LAYOUTS = {"weights": engine.GroupedLinear, "stacked": engine.StackedGroupedLinear}


def expert_weights(module: engine.GroupedLinear) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight [N, K], bias [N]) of each expert, read from the module's parameters by name (not its own code)."""
    if isinstance(module, engine.StackedGroupedLinear):
        bias = module.bias
        return [(module.weight[e], None if bias is None else bias[e]) for e in range(module.num_gemms)]
    return [(getattr(module, f"weight{e}"), getattr(module, f"bias{e}")) for e in range(module.num_gemms)]


def reference_linears(module: engine.GroupedLinear) -> list[engine.Linear]:
    refs = []
    for weight, bias in expert_weights(module):
        ref = engine.Linear(K, N, bias=bias is not None)
        with torch.no_grad():
            ref.weight.copy_(weight)
            if bias is not None:
                ref.bias.copy_(bias)
        refs.append(ref)
    return refs


def share_streams(module: engine.GroupedLinear, refs: list[engine.Linear], recipe) -> None:
    """Build the states now and give reference e the stochastic-rounding counters of the module's GEMM e."""
    module._build_states(recipe, torch.device("cpu"))
    for e, ref in enumerate(refs):
        ref._build_states(recipe, torch.device("cpu"))
        for mine, theirs in ((module._fwd_state, ref._fwd_state), (module._bwd_state, ref._bwd_state)):
            for op in OPERANDS:
                if op[1].is_forward != (mine is module._fwd_state):
                    continue
                q = mine.operand(op, e)
                if q is not None and getattr(q.rule, "rng_counter", None) is not None:
                    theirs.operand(op, 0).rule.rng_counter.copy_(q.rule.rng_counter)


def grouped_step(module, recipe, x, splits, dy):
    x = x.detach().requires_grad_()
    with engine.fp8_autocast(recipe=recipe):
        y = module(x, splits)
    y.backward(dy)
    return y.detach(), x.grad


def reference_step(refs, recipe, x, splits, dy):
    x = x.detach().requires_grad_()
    with engine.fp8_autocast(recipe=recipe):
        ys = [ref(xe) for ref, xe in zip(refs, torch.split(x, splits))]
    y = torch.cat(ys)
    y.backward(dy)
    return y.detach(), x.grad


def module_grads(module) -> list[torch.Tensor]:
    if isinstance(module, engine.StackedGroupedLinear):
        return [*module.weight.grad.unbind(0), *module.bias.grad.unbind(0)]
    return [getattr(module, f"weight{e}").grad for e in range(module.num_gemms)] + \
           [getattr(module, f"bias{e}").grad for e in range(module.num_gemms)]


def reference_grads(refs) -> list[torch.Tensor]:
    grads = [ref.weight.grad if ref.weight.grad is not None else torch.zeros_like(ref.weight) for ref in refs]
    return grads + [ref.bias.grad if ref.bias.grad is not None else torch.zeros_like(ref.bias) for ref in refs]


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got,
                       want.view(torch.int32) if want.dtype == torch.float32 else want), \
        f"{what}: max diff {(got.float() - want.float()).abs().max().item()}"


#: every case with TE's layout; the stacked layout (which differs only in how expert weights are read and their
#: gradients land) with each recipe class as built by default
LAYOUT_CASES = [pytest.param(case, "weights", id=f"{case}-weights") for case in CASES] + \
    [pytest.param(case, "stacked", id=f"{case}-stacked") for case in DEFAULTS]


@pytest.mark.parametrize("case, layout", LAYOUT_CASES)
def test_bit_exact_to_per_expert_linears(case: Case, layout: str):
    recipe = case.recipe()
    torch.manual_seed(0)
    for split_name, splits in SPLITS.items():
        module = LAYOUTS[layout](E, K, N)
        refs = reference_linears(module)
        share_streams(module, refs, recipe)
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + len(split_name))
            x = torch.randn(sum(splits), K, generator=g) * (1 + 3 * step)
            dy = torch.randn(sum(splits), N, generator=g)
            y, dx = grouped_step(module, recipe, x, splits, dy)
            y_ref, dx_ref = reference_step(refs, recipe, x, splits, dy)
            where = f"{split_name} step {step}"
            assert_bits(y, y_ref, f"out ({where})")
            assert_bits(dx, dx_ref, f"dx ({where})")
            for e, (got, want) in enumerate(zip(module_grads(module), reference_grads(refs))):
                assert_bits(got, want, f"grad {e} ({where}; weights then biases)")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_3d_input_and_bf16(layout: str):
    """inp [B, S, K] is viewed as [B*S, K] tokens; bf16 parameters and input."""
    torch.manual_seed(1)
    module = LAYOUTS[layout](E, K, N, params_dtype=torch.bfloat16)
    refs = [ref.to(torch.bfloat16) for ref in reference_linears(module)]
    x = torch.randn(2, 6, K, dtype=torch.bfloat16)
    splits = [5, 0, 4, 3]
    with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
        y = module(x, splits)
        want = torch.cat([ref(xe) for ref, xe in zip(refs, torch.split(x.view(12, K), splits))])
    assert y.shape == (2, 6, N) and y.dtype == torch.bfloat16
    assert_bits(y.view(12, N), want, "out")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_state_dict_round_trip(case: Case, layout: str):
    """Saved after a step (delayed: per-expert amax histories in `_extra_state`), loaded into a fresh module:
    the next step's output is the same bits."""
    recipe = case.recipe()
    torch.manual_seed(2)
    module = LAYOUTS[layout](E, K, N)
    splits = SPLITS["zero_and_one"]
    x = torch.randn(sum(splits), K)
    grouped_step(module, recipe, x, splits, torch.ones(sum(splits), N))
    state = module.state_dict()
    names = {"weights": {*(f"weight{e}" for e in range(E)), *(f"bias{e}" for e in range(E))},
             "stacked": {"weight", "bias"}}[layout]
    assert set(state) == names | {"_extra_state"}
    fresh = LAYOUTS[layout](E, K, N)
    fresh.load_state_dict(state)
    with engine.fp8_autocast(recipe=recipe), torch.no_grad():
        want = module(x * 2, splits)
        got = fresh(x * 2, splits)
    assert_bits(got, want, "out after load")


def test_delayed_scaling_keeps_an_amax_history_per_expert():
    """Expert 2 alone sees large inputs: its input scale shrinks; the other experts' stay where theirs were."""
    recipe = DelayedScaling()
    module = engine.GroupedLinear(E, K, N)
    x = torch.randn(8, K)
    x[2:6] *= 1000
    with engine.fp8_autocast(recipe=recipe):
        module(x, [2, 0, 4, 2])
    with engine.fp8_autocast(recipe=recipe):
        pass  # the scales update from the recorded amaxes
    state = module._fwd_state
    scales = [state.quantizer(engine.recipes.Role.INPUT, e).scale.item() for e in range(E)]
    assert scales[2] < scales[0] / 100 and scales[2] < scales[3] / 100
    assert scales[1] == 1.0  # no tokens: no amax recorded, the initial scale


@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_fp8_model_init(case: Case):
    """FP8 primary weights per expert: the same bits as per-expert Linears built under fp8_model_init."""
    recipe = case.recipe()
    torch.manual_seed(3)
    plain = engine.GroupedLinear(E, K, N)
    with engine.fp8_model_init(recipe=recipe):
        module = engine.GroupedLinear(E, K, N)
        refs = [engine.Linear(K, N) for _ in range(E)]
    assert isinstance(module.weight0, engine.QuantizedTensor)
    module.load_state_dict(plain.state_dict())
    for e, ref in enumerate(refs):
        ref.load_state_dict({"weight": getattr(plain, f"weight{e}"), "bias": getattr(plain, f"bias{e}")})
    share_streams(module, refs, recipe)
    splits = SPLITS["zero_and_one"]
    x, dy = torch.randn(sum(splits), K), torch.randn(sum(splits), N)
    y, dx = grouped_step(module, recipe, x, splits, dy)
    y_ref, dx_ref = reference_step(refs, recipe, x, splits, dy)
    assert_bits(y, y_ref, "out")
    assert_bits(dx, dx_ref, "dx")


def test_stacked_refuses_fp8_model_init_and_fused_wgrad():
    with engine.fp8_model_init(recipe=DelayedScaling()), pytest.raises(TypeError, match="GroupedLinear"):
        engine.StackedGroupedLinear(E, K, N)
    with pytest.raises(ValueError, match="main_grad per expert"):
        engine.StackedGroupedLinear(E, K, N, fuse_wgrad_accumulation=True)


def test_fuse_wgrad_accumulation_and_torch_autocast():
    """Per-expert main_grad accumulation, and torch.autocast(bf16) around the forward: as per-expert Linears."""
    torch.manual_seed(8)
    recipe = MXFP8BlockScaling()
    module = engine.GroupedLinear(E, K, N, fuse_wgrad_accumulation=True)
    refs = []
    for weight, bias in expert_weights(module):
        ref = engine.Linear(K, N, fuse_wgrad_accumulation=True)
        ref.load_state_dict({"weight": weight, "bias": bias})
        refs.append(ref)
    for p in [*(w for w, _ in expert_weights(module)), *(r.weight for r in refs)]:
        p.main_grad = torch.zeros(N, K)
    splits = SPLITS["zero_and_one"]
    x, dy = torch.randn(sum(splits), K), torch.randn(sum(splits), N, dtype=torch.bfloat16)
    outs = []
    for run in (lambda t: module(t, splits), lambda t: torch.cat([r(te) for r, te in zip(refs, torch.split(t, splits))])):
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), engine.fp8_autocast(recipe=recipe):
            y = run(xr)
        y.backward(dy)
        outs.append((y, xr.grad))
    assert_bits(outs[0][0], outs[1][0], "out")
    assert_bits(outs[0][1], outs[1][1], "dx")
    for e, ((w, _), ref) in enumerate(zip(expert_weights(module), refs)):
        assert_bits(w.main_grad, ref.weight.main_grad, f"main_grad {e}")
        assert w.main_grad.abs().sum() > 0 or splits[e] == 0


def test_torch_autocast_on_the_grouped_path():
    """torch.autocast(bf16) with a recipe the grouped path takes (MXFP8): bf16 output, the per-expert Linears' bits."""
    torch.manual_seed(9)
    module = engine.GroupedLinear(E, K, N)
    refs = reference_linears(module)
    splits = SPLITS["zero_and_one"]
    x = torch.randn(sum(splits), K)
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.fp8_autocast(recipe=MXFP8BlockScaling()):
        y = module(x, splits)
        want = torch.cat([r(xe) for r, xe in zip(refs, torch.split(x, splits))])
    assert y.dtype == torch.bfloat16
    assert_bits(y, want, "out")


@pytest.mark.parametrize("recipe", [DelayedScaling(), engine.recipes.NVFP4BlockScaling()], ids=lambda r: r.name)
def test_recompute(recipe):
    """engine.checkpoint replays the forward with the same scales and random streams: same grads."""
    torch.manual_seed(4)
    module = engine.GroupedLinear(E, K, N)
    splits = SPLITS["zero_and_one"]
    x = torch.randn(sum(splits), K)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(5)
        module = engine.GroupedLinear(E, K, N)
        xr = x.clone().requires_grad_()
        with engine.fp8_autocast(recipe=recipe):
            y = engine.checkpoint(module, xr, splits, use_reentrant=False) if recompute else module(xr, splits)
        y.pow(2).sum().backward()
        grads.append([xr.grad, *module_grads(module)])
    for e, (got, want) in enumerate(zip(*grads)):
        assert_bits(got, want, f"grad {e}")


@pytest.mark.parametrize("layout", ["stacked"])  # the weights layout runs the same per-expert ops
def test_compile_matches_eager(layout: str):
    torch.manual_seed(6)
    recipe = DelayedScaling()
    eager = LAYOUTS[layout](E, K, N)
    compiled_module = LAYOUTS[layout](E, K, N)
    compiled_module.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    splits = SPLITS["zero_and_one"]
    for step in range(2):
        x, dy = torch.randn(sum(splits), K), torch.randn(sum(splits), N)
        y, dx = grouped_step(eager, recipe, x, splits, dy)
        y_c, dx_c = grouped_step(compiled, recipe, x, splits, dy)
        assert_bits(y_c, y, f"out step {step}")
        assert_bits(dx_c, dx, f"dx step {step}")
    for e, (got, want) in enumerate(zip(module_grads(compiled_module), module_grads(eager))):
        assert_bits(got, want, f"grad {e}")


def test_recipe_map_pick():
    """A RecipeMap's pick: None keeps the experts in high precision (torch's linear per expert)."""
    model = torch.nn.Sequential(engine.GroupedLinear(E, K, N))
    engine.set_recipe_map(model, RecipeMap(rules=[("0", None)], default=DelayedScaling()))
    splits = SPLITS["zero_and_one"]
    x = torch.randn(sum(splits), K)
    with engine.fp8_autocast(recipe=RecipeMap(rules=[("0", None)], default=DelayedScaling())):
        y = model[0](x, splits)
    want = torch.cat([torch.nn.functional.linear(xe, w, b) for xe, (w, b)
                      in zip(torch.split(x, splits), expert_weights(model[0]))])
    assert_bits(y.detach(), want.detach(), "out")
    assert model[0]._fwd_state is None  # never quantized


@pytest.mark.parametrize("splits, error, match", [
    ([1, 2, 3], ValueError, "one entry per expert"),
    ([1, 2, 3, 4], ValueError, "sum to the number of tokens"),
    ([-1, 2, 2, 3], ValueError, ">= 0"),
    ([1.0, 2, 2, 1], TypeError, "ints"),
    (torch.tensor([1, 2, 2, 1]), TypeError, "tolist"),
    (None, TypeError, "list of 4 ints"),
])
def test_bad_m_splits(splits, error, match):
    module = engine.GroupedLinear(E, K, N)
    with pytest.raises(error, match=match):
        module(torch.randn(6, K), splits)


def test_bad_input_and_arguments():
    module = engine.GroupedLinear(E, K, N)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        module(torch.ones(4, K, dtype=torch.int32), [1, 1, 1, 1])
    with pytest.raises(ValueError, match="last dim must be 64"):
        module(torch.ones(4, K + 1), [1, 1, 1, 1])
    with pytest.raises(ValueError, match="num_gemms"):
        engine.GroupedLinear(0, K, N)
    with pytest.raises(TypeError, match="params_dtype"):
        engine.StackedGroupedLinear(E, K, N, params_dtype=torch.int8)


def test_inspect_names_each_expert():
    """engine.inspect watches each expert's GEMMs (the per-expert path), named `<module>.expert<e>`."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = engine.GroupedLinear(E, K, N)

        def forward(self, x):
            return self.experts(x, [3, 0, 6, 1])

    model = Model()
    with engine.inspect(model) as inspector:
        with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
            y = model(torch.randn(10, K, requires_grad=True))
        y.sum().backward()
    names = {r["layer"] for r in inspector.records}
    assert names == {f"experts.expert{e}" for e in range(E)}
    assert {r["gemm"] for r in inspector.records if r["kind"] == "gemm"} == {"fprop", "dgrad", "wgrad"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_return_bias(layout: str):
    """return_bias: the output without the biases, and the biases (TE: a list; stacked: the [E, N] parameter)."""
    torch.manual_seed(10)
    module = LAYOUTS[layout](E, K, N, return_bias=True)
    splits = SPLITS["zero_and_one"]
    x = torch.randn(sum(splits), K)
    with torch.no_grad():
        out, biases = module(x, splits)
        want = torch.cat([torch.nn.functional.linear(xe, w) for xe, (w, _) in zip(torch.split(x, splits),
                                                                                    expert_weights(module))])
    assert_bits(out, want, "out without bias")
    assert [b.data_ptr() for b in (biases if layout == "weights" else biases.unbind(0))] == \
        [b.data_ptr() for _, b in expert_weights(module)]


@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_grouped_experts_bit_exact_to_per_expert_linears(case: Case):
    """engine.GroupedExperts.grouped: per expert, gate_up and down as two engine.Linear modules (GEMM indices e
    and E + e of its states), the gate's SiLU times up between; two steps, forward and every gradient."""
    recipe = case.recipe()
    torch.manual_seed(11)
    hidden, inter = 32, 32
    experts = engine.GroupedExperts(E, hidden, inter)
    fc1 = [engine.Linear(hidden, 2 * inter, bias=False) for _ in range(E)]
    fc2 = [engine.Linear(inter, hidden, bias=False) for _ in range(E)]
    with torch.no_grad():
        for e in range(E):
            fc1[e].weight.copy_(experts.gate_up_proj[e])
            fc2[e].weight.copy_(experts.down_proj[e])
    experts._build_states(recipe, torch.device("cpu"))
    for refs, offset in ((fc1, 0), (fc2, E)):  # the references get the streams of their GEMM index
        for e, ref in enumerate(refs):
            ref._build_states(recipe, torch.device("cpu"))
            for mine, theirs in ((experts._fwd_state, ref._fwd_state), (experts._bwd_state, ref._bwd_state)):
                for op in OPERANDS:
                    if op[1].is_forward != (mine is experts._fwd_state):
                        continue
                    q = mine.operand(op, offset + e)
                    if q is not None and getattr(q.rule, "rng_counter", None) is not None:
                        theirs.operand(op, 0).rule.rng_counter.copy_(q.rule.rng_counter)
    splits = SPLITS["zero_and_one"]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, dy = torch.randn(sum(splits), hidden, generator=g), torch.randn(sum(splits), hidden, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with engine.fp8_autocast(recipe=recipe):
            y = experts.grouped(xa, splits)
            outs = []
            for e, xe in enumerate(torch.split(xb, splits)):
                gate, up = fc1[e](xe).chunk(2, dim=-1)
                outs.append(fc2[e](torch.nn.functional.silu(gate) * up))
            want = torch.cat(outs)
        y.backward(dy)
        want.backward(dy)
        assert_bits(y.detach(), want.detach(), f"out step {step}")
        assert_bits(xa.grad, xb.grad, f"dx step {step}")
    for e in range(E):
        for got, ref, what in ((experts.gate_up_proj.grad[e], fc1[e], "gate_up"), (experts.down_proj.grad[e], fc2[e], "down")):
            want = ref.weight.grad if ref.weight.grad is not None else torch.zeros_like(ref.weight)
            assert_bits(got, want, f"{what} grad {e}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_keep_holds_a_share_of_the_experts(layout: str):
    """keep(first, stop) (expert parallel: a rank's share): experts first..stop-1 renumbered from 0, the same bits."""
    torch.manual_seed(0)
    whole = LAYOUTS[layout](4, 32, 16)
    share = LAYOUTS[layout](4, 32, 16)
    share.load_state_dict(whole.state_dict())
    share.keep(1, 3)
    assert share.num_gemms == 2 and len(share.expert_parameters()[0]) == 2
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    recipe = engine.recipes.Float8CurrentScaling()
    with engine.fp8_autocast(recipe=recipe):
        want = whole(x, [0, 3, 4, 0])
    with engine.fp8_autocast(recipe=recipe):
        got = share(x, [3, 4])
    assert_bits(got, want, "output")
    with pytest.raises(RuntimeError, match="before the first step"):
        whole.keep(0, 2)
    with pytest.raises(ValueError, match="first < stop"):
        share.keep(1, 1)
