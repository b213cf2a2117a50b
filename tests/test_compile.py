"""torch.compile(fullgraph=True) of engine modules: no graph breaks, no recompiles, eager's bits.

Most tests use the "aot_eager" backend (Dynamo and AOTAutograd as torch.compile runs them, the
graph executed without Inductor's code generation, which takes minutes on these CPUs); one runs
Inductor. The custom ops run the eager implementation in both, so outputs, gradients and
delayed-scaling state must be bit-identical to eager whenever the graph around them is ours.

Every recipe `engine.recipes` exports compiles whole with eager's bits in tests/test_compile_every_format.py;
here: an operand mix no recipe class makes, bf16 models, recompiles, and running outside fp8_autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import engine
from engine.modules import FP8Module
from engine.recipes import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, OperandRecipe, QuantizerSpec,
)

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    # a high-precision wgrad input and a delayed-free mix: the ops save plain tensors too
    "operands": OperandRecipe(operands={
        "fprop_input": QuantizerSpec(layout="tensor", element="e4m3"),
        "fprop_weight": QuantizerSpec(layout="tensor", element="e4m3"),
        "dgrad_grad_output": QuantizerSpec(layout="mx", element="e5m2", scaling="e8m0"),
        "dgrad_weight": QuantizerSpec(layout="mx", element="e4m3", scaling="e8m0"),
        "wgrad_grad_output": None,
        "wgrad_input": None,
    }),
}


class Stack(torch.nn.Module):
    """Only engine modules and a residual add: every op with rounding in it is ours."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.qkv = engine.LayerNormLinear(width, width)
        self.proj = engine.Linear(width, width)
        self.mlp = engine.LayerNormMLP(width, 2 * width, activation="gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.qkv(x))
        return x + self.mlp(x)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def run_steps(model, recipe, inputs):
    """Forward in fp8_autocast, backward after it (the README's loop); returns outputs and input grads."""
    outs, grads = [], []
    for x in inputs:
        x = x.clone().requires_grad_()
        with engine.fp8_autocast(recipe=recipe):
            out = model(x)
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    return outs, grads


def state_tensors(model):
    return [t for m in model.modules() if isinstance(m, FP8Module)
            for s in (m._fwd_state, m._bwd_state) for t in s.op_tensors()]


def test_compiled_steps_of_an_operand_mix_have_eager_bits_no_breaks_and_no_recompiles():
    """MX E5M2 gradients against per-tensor forward operands, wgrad in high precision, three steps of growing
    inputs (the recipe classes: tests/test_compile_every_format.py)."""
    recipe = RECIPES["operands"]
    torch.manual_seed(0)
    eager = Stack()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    inputs = [torch.randn(2, 16, 64) * (i + 1) for i in range(3)]
    want_out, want_grad = run_steps(eager, recipe, inputs)
    with engine.fp8_autocast(recipe=recipe):  # fold in the last backward before the other run starts
        pass
    got_out, got_grad = run_steps(compiled, recipe, inputs)
    assert counters["stats"]["unique_graphs"] == 1  # one graph, compiled once for all three steps
    assert not counters["graph_break"]
    for want, got in zip(want_out + want_grad, got_out + got_grad):
        assert torch.equal(want, got)
    for (pname, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        assert torch.equal(p.grad, q.grad), pname
    with engine.fp8_autocast(recipe=recipe):  # fold in the last backward
        pass
    for want, got in zip(state_tensors(eager), state_tensors(compiled_model)):
        assert torch.equal(want, got)


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_explain_counts_no_graph_break_in_a_bf16_model(name):
    model = Stack().to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with engine.fp8_autocast(recipe=RECIPES[name]):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_a_new_batch_size_recompiles_once_then_shapes_are_dynamic():
    model = torch.compile(Stack(), fullgraph=True, backend="aot_eager")
    recipe = RECIPES["current"]
    for batch in (2, 3, 5, 7):
        run_steps(model, recipe, [torch.randn(batch, 16, 64)])
    assert counters["stats"]["unique_graphs"] == 2


def test_a_new_recipe_recompiles_and_builds_its_states():
    model = Stack()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, 64)
    run_steps(compiled, RECIPES["current"], [x])
    run_steps(compiled, Float8CurrentScaling(), [x])  # an equal recipe object: no recompile
    assert counters["stats"]["unique_graphs"] == 1
    run_steps(compiled, RECIPES["delayed"], [x])
    assert counters["stats"]["unique_graphs"] == 2
    assert model.proj._fwd_state.recipe == RECIPES["delayed"]


def test_outside_fp8_autocast_the_compiled_model_runs_plain_linears():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 16, 64)
    want = model(x)
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("what", ["fuse_wgrad_accumulation", "is_first_microbatch"])
def test_unsupported_features_say_so_under_compile(what):
    layer = engine.Linear(32, 32, fuse_wgrad_accumulation=what == "fuse_wgrad_accumulation")
    kwargs = {"is_first_microbatch": True} if what == "is_first_microbatch" else {}
    compiled = torch.compile(lambda x: layer(x, **kwargs), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as err:
        with engine.fp8_autocast(recipe=RECIPES["current"]):
            compiled(torch.randn(4, 32, requires_grad=True))
    first = str(err.value).splitlines()[0]  # engine's reason, not Dynamo's "Observed exception"
    assert first.startswith("torch.compile: ") and what in first, str(err.value)


def test_inductor_matches_eager_for_a_linear_stack():
    """Inductor compiles the graph around the ops; with only engine modules the bits stay eager's."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(engine.Linear(32, 32), engine.Linear(32, 32))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    inputs = [torch.randn(8, 32) for _ in range(2)]
    recipe = RECIPES["delayed"]
    want_out, want_grad = run_steps(eager, recipe, inputs)
    with engine.fp8_autocast(recipe=recipe):  # fold in the last backward before the other run starts
        pass
    got_out, got_grad = run_steps(compiled, recipe, inputs)
    with engine.fp8_autocast(recipe=recipe):
        pass
    for want, got in zip(want_out + want_grad, got_out + got_grad):
        assert torch.equal(want, got)
    for want, got in zip(state_tensors(eager), state_tensors(compiled_model)):
        assert torch.equal(want, got)


def test_the_ops_pass_torch_library_opcheck():
    from engine.modules import linear_op

    recipe = RECIPES["delayed"]
    layer = engine.Linear(32, 16)
    with engine.fp8_autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    fwd, bwd = layer._fwd_state, layer._bwd_state
    x, w, b = torch.randn(4, 32), torch.randn(16, 32, requires_grad=True), torch.randn(16)
    args = (x, w, b, fwd.op_tensors(), bwd.op_tensors(), fwd.key, 1, 0, True, True)
    torch.library.opcheck(linear_op.linear_fwd, args, test_utils=("test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("name", ["delayed", "block"])
def test_a_converted_hugging_face_llama_compiles_whole(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    eager = engine.convert(transformers.LlamaForCausalLM(config))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 128, (2, 16))
    losses = {}
    for label, model in (("eager", eager), ("compiled", compiled)):
        losses[label] = []
        for _ in range(2):
            with engine.fp8_autocast(recipe=RECIPES[name]):
                loss = model(ids, labels=ids).loss
            loss.backward()
            losses[label].append(loss.detach())
        with engine.fp8_autocast(recipe=RECIPES[name]):
            pass
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for want, got in zip(losses["eager"], losses["compiled"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # decomposed attention/softmax may round apart
    grads = [(p.grad, q.grad) for p, q in zip(eager.parameters(), compiled_model.parameters())]
    for want, got in grads:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("frozen", ["input", "weights"])
def test_compiled_grads_when_only_some_inputs_need_them(frozen):
    """No dgrad when the input needs no gradient (a first layer), no wgrad for frozen weights."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(engine.Linear(32, 32), engine.Linear(32, 32))
    if frozen == "weights":
        eager[1].weight.requires_grad_(False)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32, requires_grad=frozen == "weights")
    for model in (eager, compiled):
        with engine.fp8_autocast(recipe=RECIPES["current"]):
            out = model(x)
        out.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_the_states_hook_is_marked_as_torch_marks_an_assumed_constant():
    """engine marks `_states_while_tracing` by hand (importing torch._dynamo at `import engine` costs ~2.5 s);
    torch's decorator must still mean exactly that mark."""
    from engine.modules.base import _states_while_tracing
    from engine.modules.linear_op import refuse_to_compile

    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    extra = {k: v for k, v in vars(marked).items() if not k.startswith("__")}
    assert extra == {"_dynamo_marked_constant": True}
    assert _states_while_tracing._dynamo_marked_constant is True
    assert refuse_to_compile._dynamo_marked_constant is True  # what makes its error leave Dynamo unwrapped


@pytest.mark.parametrize("dgrad_weight", ["mx", "high precision"])
def test_fp8_primary_weights_whose_dgrad_use_the_recipe_quantizes_otherwise(dgrad_weight):
    """An FP8 primary weight is quantized by its fprop quantizer (per tensor here); eager's dgrad reads that storage
    as it is where the recipe quantizes the dgrad weight (MX here) and its dequantized value where the recipe keeps
    it in high precision: the compiled ops do the same (every recipe's own weights: test_compile_every_format.py)."""
    spec = None if dgrad_weight == "high precision" else QuantizerSpec(layout="mx", element="e4m3", scaling="e8m0")
    recipe = OperandRecipe(operands={
        "fprop_input": QuantizerSpec(layout="tensor", element="e4m3"),
        "fprop_weight": QuantizerSpec(layout="tensor", element="e4m3"),
        "dgrad_grad_output": QuantizerSpec(layout="mx", element="e5m2", scaling="e8m0"),
        "dgrad_weight": spec,
    })

    def build():
        torch.manual_seed(0)
        with engine.fp8_model_init(recipe=recipe):
            return Stack()

    eager, compiled_model = build(), build()
    assert compiled_model.proj.weight.scheme.layout == "tensor"
    inputs = [torch.randn(2, 16, 64) * (i + 1) for i in range(2)]
    want_out, want_grad = run_steps(eager, recipe, inputs)
    got_out, got_grad = run_steps(torch.compile(compiled_model, fullgraph=True, backend="aot_eager"), recipe, inputs)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for want, got in zip(want_out + want_grad, got_out + got_grad):
        assert torch.equal(want, got)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        assert torch.equal(p.grad, q.grad), name
