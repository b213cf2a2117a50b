"""What the checkpoint fixtures are: their names, models, recipes, inputs and how each is trained or quantized.

Shared by tests/fixtures/make_checkpoints.py (writes tests/fixtures/checkpoints/<name>.pt once) and
tests/test_checkpoint_fixtures.py (builds the identical model, loads the file, compares the output bit for bit).
The recipes and inference configs are derived from the package, so a new recipe class in `engine.recipes` or
a new config (or field value) in `engine.inference` is a fixture that does not exist yet.

Fixture names:
    train-<RecipeClass>-hp     high-precision weights trained 2 steps under the recipe (state dict with the
                               modules' `_extra_state` scaling records)
    train-<RecipeClass>-fp8    the same model built under fp8_model_init (FP8 primary weights, saved as their
                               component keys), trained 2 steps
    train-<RecipeClass>-fp8odd FP8 primary weights of odd shapes (widths 19 -> 37 -> 19 -> 21, 11 tokens:
                               partial blocks in every format), trained 2 steps
    infer-<Config>[-<field>=<value>...]   a bf16 model `engine.quantize_`d with the config
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

import engine
from engine.inference import CONFIGS, InferenceConfig, configs as config_choices
from engine.recipes import QuantizerSpec, Recipe

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "checkpoints"
SCRIPT = "tests/fixtures/make_checkpoints.py"
TRAIN_STEPS = 2
WIDTH, FFN, OUT = 32, 32, 48  # multiples of 16 (NVFP4 blocks) and 32 (MX blocks) where a block runs along them
TRAIN_TOKENS, TOKENS = 32, 8  # tokens of a training batch; of the stored input (fewer: smaller files)
ODD_WIDTH, ODD_FFN, ODD_OUT, ODD_TOKENS = 19, 37, 21, 11



def custom_qfactory(role: engine.recipes.QuantizerRole) -> Any:
    """CustomRecipe's fixture factory, one kind of answer per GEMM: LayerNormMLP's fc1 delayed scaling (a spec: the
    module saves its scale and amax history), fc2 MXFP8 quantizers and an MXFP8 E5M2 spec for dy; Linear NVFP4 (16x16
    weight tiles, dy stochastically rounded: its counter is saved) with wgrad's x in high precision."""
    forward = role.tensor_type != "grad_output"
    if role.name == "fc1":
        return QuantizerSpec(scheme="tensor_e4m3" if forward else "tensor_e5m2", rule="delayed",
                             params={"amax_history_len": 4})
    if role.name == "fc2":
        if forward:
            return engine.quantizers.MXFP8Quantizer(torch.float8_e4m3fn)
        return QuantizerSpec(scheme="mx_e5m2", rule="e8m0")
    if role == "linear_grad_output":
        return QuantizerSpec(scheme="nvfp4_e2m1", rule="nvfp4", params={"stochastic_rounding": True})
    if role == "linear_weight":
        return QuantizerSpec(scheme="nvfp4_e2m1", rule="nvfp4", params={"with_2d_quantization": True})
    return None if role.gemm == "wgrad" else QuantizerSpec(scheme="nvfp4_e2m1", rule="nvfp4")


#: fields a recipe is built with here other than its defaults (a short amax history keeps the files small;
#: OperandRecipe's default quantizes nothing, so it gets the mixed example of its docstring; CustomRecipe has no
#: default factory)
RECIPE_FIELDS: dict[str, Callable[[], dict[str, Any]]] = {
    "CustomRecipe": lambda: {"qfactory": custom_qfactory},
    "Debug": lambda: {"recipe": engine.recipes.NVFP4BlockScaling(), "high_precision": ("wgrad",)},
    "DelayedScaling": lambda: {"amax_history_len": 4},
    "OperandRecipe": lambda: {"operands": {
        "fprop_input": QuantizerSpec(layout="tensor", element="e4m3"),
        "fprop_weight": QuantizerSpec(layout="tensor", element="e4m3"),
        "dgrad_grad_output": QuantizerSpec(layout="tensor", element="e5m2"),
        "dgrad_weight": QuantizerSpec(layout="tensor", element="e4m3")}},
}
#: recipes that cannot take the odd shapes (none today: every format has partial blocks)
EVEN_SHAPES_ONLY: frozenset[str] = frozenset()
#: every value each inference config field takes (the configs' own choice lists)
CONFIG_CHOICES: dict[str, tuple] = {
    "group_size": config_choices.INT4_GROUP_SIZES, "element": config_choices.MX_ELEMENTS,
    "granularity": config_choices.FLOAT8_GRANULARITIES, "scale_mode": config_choices.MX_SCALE_MODES,
}


def exported_recipe_classes() -> list[type[Recipe]]:
    """Every recipe class `engine.recipes` exports (as tests/test_saving.py's every-recipe test finds them)."""
    classes = [getattr(engine.recipes, name) for name in engine.recipes.__all__]
    return [cls for cls in classes if isinstance(cls, type) and issubclass(cls, Recipe) and cls is not Recipe]


def make_recipe(class_name: str) -> Recipe:
    cls = getattr(engine.recipes, class_name)
    return cls(**RECIPE_FIELDS.get(class_name, dict)())


def every_config() -> list[InferenceConfig]:
    """Every config class `engine.inference` knows, with every value of each of its fields (all combinations)."""
    out = []
    for cls in CONFIGS.values():
        names = [f.name for f in fields(cls)]
        unknown = [n for n in names if n not in CONFIG_CHOICES]
        if unknown:
            raise KeyError(f"{cls.__name__}.{unknown[0]}: add the field's values to CONFIG_CHOICES in "
                           "tests/checkpoint_specs.py")
        for values in itertools.product(*(CONFIG_CHOICES[n] for n in names)):
            out.append(cls(**dict(zip(names, values))))
    return out


def config_name(config: InferenceConfig) -> str:
    plain = config.to_plain()
    return "-".join([f"infer-{plain.pop('name')}", *(f"{k}={v}" for k, v in plain.items())])


# ---------------------------------------------------------------------------- models
class TrainModel(torch.nn.Module):
    """engine.LayerNormMLP at `width` -> engine.Linear width -> out, with bias."""

    def __init__(self, width: int = WIDTH, ffn: int = FFN, out: int = OUT) -> None:
        super().__init__()
        self.mlp = engine.LayerNormMLP(width, ffn)
        self.out = engine.Linear(width, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(x))


class InferenceModel(torch.nn.Module):
    """Every kind of layer quantize_ swaps: engine.LayerNormMLP (fc1, fc2), engine.Linear, torch.nn.Linear; bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = engine.LayerNormMLP(WIDTH, FFN)
        self.proj = engine.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.mlp(x)))


@dataclass(frozen=True)
class Fixture:
    """One fixture: `build(seed)` makes its model (quantize_d / under fp8_model_init as the fixture is),
    `context()` is what its forward runs under; its input is [tokens, width] of `dtype` (training batches have
    `train_tokens` rows)."""

    name: str
    build: Callable[[int], torch.nn.Module]
    context: Callable[[], ContextManager]
    recipe_class: str | None = None
    config: InferenceConfig | None = None
    width: int = WIDTH
    tokens: int = TOKENS
    train_tokens: int = TRAIN_TOKENS
    dtype: torch.dtype = torch.float32

    def make_input(self, seed: int = 1234, tokens: int | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.tokens if tokens is None else tokens, self.width, generator=gen).to(self.dtype)


def _train_fixture(class_name: str, variant: str) -> Fixture:
    fp8, odd = variant.startswith("fp8"), variant.endswith("odd")
    shape = (ODD_WIDTH, ODD_FFN, ODD_OUT) if odd else (WIDTH, FFN, OUT)

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        with engine.fp8_model_init(enabled=fp8, recipe=make_recipe(class_name)):
            return TrainModel(*shape)

    return Fixture(f"train-{class_name}-{variant}", build, lambda: engine.fp8_autocast(recipe=make_recipe(class_name)),
                   recipe_class=class_name, width=shape[0], tokens=ODD_TOKENS if odd else TOKENS,
                   train_tokens=ODD_TOKENS if odd else TRAIN_TOKENS)


def _infer_fixture(config: InferenceConfig) -> Fixture:
    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return engine.quantize_(InferenceModel().bfloat16(), config)

    return Fixture(config_name(config), build, contextlib.nullcontext, config=config, dtype=torch.bfloat16)


def fixtures() -> dict[str, Fixture]:
    """Every fixture the package's recipes and configs call for, by name."""
    out = []
    for cls in exported_recipe_classes():
        variants = ("hp", "fp8") if cls.__name__ in EVEN_SHAPES_ONLY else ("hp", "fp8", "fp8odd")
        out += [_train_fixture(cls.__name__, v) for v in variants]
    out += [_infer_fixture(c) for c in every_config()]
    return {f.name: f for f in out}


def train(model: torch.nn.Module, fixture: Fixture, steps: int = TRAIN_STEPS) -> None:
    """`steps` SGD steps on fixed random batches under the fixture's recipe."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = fixture.make_input(seed=step, tokens=fixture.train_tokens)
        with fixture.context():
            loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def output(model: torch.nn.Module, fixture: Fixture, x: torch.Tensor) -> torch.Tensor:
    """The model's forward of x under the fixture's recipe (no grad), with pinned numerics."""
    with torch.no_grad(), pinned_numerics(), fixture.context():
        return model(x)


@contextlib.contextmanager
def pinned_numerics() -> Iterator[None]:
    """One thread, and engine's C++ kernels at their baseline ISA (or the reference ops where they did not build:
    the same bits, checked when the fixtures were written). The GEMMs' fp32 summation order is unspecified
    (engine/gemm/cpu.py: oneDNN's, or the AVX-512 kernel's); with these pins it is fixed on one kind of CPU."""
    from engine.ops import native

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with native.use_isa("baseline") if native.available() else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads)


def cpu_capability() -> str:
    """The CPU kind torch's and oneDNN's kernels were chosen for (e.g. "AVX512"): outputs are bitwise on one kind."""
    return torch.backends.cpu.get_cpu_capability()


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def decode_text(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode()


def path_of(name: str) -> Path:
    return FIXTURE_DIR / f"{name}.pt"
