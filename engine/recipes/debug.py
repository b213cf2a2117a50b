"""Debug: a recipe with Transformer Engine's debug switches (its `transformer_engine/debug` features) as data.

    Debug(NVFP4BlockScaling(), high_precision=("wgrad",))        # wgrad's operands stay unquantized
    Debug(MXFP8BlockScaling(), fake_quantize=("fprop",))          # fprop on dequantize(quantize(x)), in fp32
    Debug(NVFP4BlockScaling(), current_scaling=("dgrad",))       # dgrad's operands in per-tensor FP8, current
    Debug(DelayedScaling(), dump_step=100, dump_dir="dumps")     # the operands of the 101st call, to safetensors

It wraps any other recipe and changes only the GEMMs it names ("fprop", "dgrad", "wgrad"); a RecipeMap's
rule takes it like any recipe, so the switches are set per layer pattern and saved with the model
(`recipe_to_plain`, the module's `_extra_state`). What each switch does to a named GEMM's operands:

* high_precision: no quantizer (the GEMM reads the high-precision tensors, as an OperandRecipe's None does).
* fake_quantize: each use quantized alone by the wrapped recipe's quantizer and dequantized; the GEMM runs in
  fp32 on those values (what a quantization-aware-training fake quantizer computes).
* current_scaling: per-tensor current scaling to FP8 (the wrapped recipe's FP8 element, or E4M3 forward and
  E5M2 backward where its element is not FP8).
* dump_step / dump_dir: the n-th quantization (0-based) of each quantized operand of the layer - in a loop with
  one forward and backward per step, the training step n - is written to
  `dump_dir/<layer>[.<gemm name>].<operand>.step<n>.safetensors`: "input" (the high-precision tensor) and the
  dequantized value of each usage the quantizer made ("rowwise", "columnwise"). An operand a switch keeps in
  high precision has no quantization, so no file. `<layer>` is the module's name (`engine.set_recipe_map`).

Under torch.compile: high_precision, current_scaling and fake_quantize (the compiled ops rebuild the switched
quantizers from the recipe key); dumps run eagerly only (a clear error). With fake_quantize, FP8 primary weights
(fp8_model_init) are read as stored and `engine.inspect` sees no quantized operand.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

import torch
from pydantic import field_validator, model_validator

from engine.recipes.base import Recipe, RecipeState
from engine.recipes.format import Format, fixed_format
from engine.recipes.operands import Operand, QuantizerSpec, Role
from engine.schemes import fp8_scheme

GemmName = Literal["fprop", "dgrad", "wgrad"]
SWITCHES = ("high_precision", "fake_quantize", "current_scaling")


class Debug(Recipe):
    """`recipe` with the debug switches applied to the GEMMs they name (module docstring)."""

    name: ClassVar[str] = "debug"

    recipe: Recipe
    high_precision: tuple[GemmName, ...] = ()
    fake_quantize: tuple[GemmName, ...] = ()
    current_scaling: tuple[GemmName, ...] = ()
    dump_step: int | None = None
    dump_dir: str | None = None

    def __init__(self, recipe: Recipe | None = None, **fields: Any) -> None:
        if recipe is not None:
            fields["recipe"] = recipe
        super().__init__(**fields)

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _format_is_the_recipes(cls, value: Format) -> Format:
        return fixed_format(value, Format.HYBRID, cls.__name__, "takes its elements from the recipe it wraps")

    @field_validator("recipe", mode="before")
    @classmethod
    def _inner(cls, value: Any) -> Any:
        if not isinstance(value, Recipe):
            raise ValueError(f"expected an engine recipe to debug, got {type(value).__name__}")
        if isinstance(value, Debug):
            raise ValueError("expected a recipe other than Debug (give one Debug all its switches)")
        return value

    @field_validator(*SWITCHES, mode="before")
    @classmethod
    def _gemms(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(f"expected a tuple of GEMM names (e.g. ('wgrad',)), got the string {value!r}")
        return tuple(value) if isinstance(value, list) else value

    @field_validator("dump_step")
    @classmethod
    def _step(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"expected an int >= 0 (the 0-based call to dump) or None, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Debug:
        for switch in SWITCHES:
            names = getattr(self, switch)
            if len(set(names)) != len(names):
                raise ValueError(f"{switch}: a GEMM named twice, got {names}")
        both = sorted(set(self.high_precision) & (set(self.fake_quantize) | set(self.current_scaling)))
        if both:
            raise ValueError(f"high_precision: {both} also has fake_quantize or current_scaling, which quantize it")
        if (self.dump_step is None) != (self.dump_dir is None):
            raise ValueError(f"dump_step / dump_dir: give both or neither, got dump_step={self.dump_step!r}, "
                             f"dump_dir={self.dump_dir!r}")
        if self.dump_dir == "":
            raise ValueError("dump_dir: expected a directory, got ''")
        return self

    # ------------------------------------------------------------------ the wrapped recipe's, switched
    def dtype_for(self, role: Role) -> torch.dtype:
        return self.recipe.dtype_for(role)

    def element_for(self, role: Role) -> str:
        return self.recipe.element_for(role)

    def current_spec(self, role: Role) -> QuantizerSpec:
        """The per-tensor current-scaling spec `current_scaling` gives an operand of `role`."""
        element = self.recipe.element_for(role)
        if element in ("e4m3", "e5m2"):
            dtype = self.recipe.dtype_for(role)
        else:
            dtype = torch.float8_e4m3fn if role.is_forward else torch.float8_e5m2
        return QuantizerSpec(scheme=fp8_scheme("tensor", dtype).name, rule="current", params={})

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        """The wrapped recipe's specs with high_precision (None) and current_scaling applied (fake_quantize and
        dumps change how a spec's output is used, not the spec)."""
        specs = dict(self.recipe.operands())
        for op, spec in specs.items():
            if op[0].value in self.high_precision:
                specs[op] = None
            elif op[0].value in self.current_scaling and spec is not None:
                specs[op] = self.current_spec(op[1])
        return specs

    def make_state(self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None,
                   module: str = "", gemm_names: Sequence[str] = ()) -> RecipeState:
        from engine.recipes.debug_state import DebugState

        inner = self.recipe.make_state(forward=forward, num_gemms=num_gemms, device=device, module=module,
                                       gemm_names=gemm_names)
        return DebugState(self, inner, tuple(gemm_names))

    def check_saved_state(self, part: Any, where: str, slots: int) -> None:
        self.recipe.check_saved_state(part, where, slots)  # the scaling state is the wrapped recipe's

    @property
    def compile_refusal(self) -> str | None:
        """Why the compiled layers cannot run this recipe (None: they can). high_precision and current_scaling
        only change operand specs, and fake_quantize only the quantizers' output, all of which the compiled ops
        rebuild from the recipe key (a fake-quantized operand saved for backward is its dequantized tensor);
        dumps count one module's calls and write files, which the ops (made once per key, shared by every
        module) cannot do per module."""
        if self.dump_step is not None:
            return ("torch.compile: engine.recipes.Debug with dump_step runs eagerly only; compile without "
                    "dump_step / dump_dir, or run the model eagerly")
        return None

    def op_state(self, *, forward: bool, num_gemms: int, tensors: list[torch.Tensor]) -> Any:
        from engine.recipes.debug_state import DebugState

        if self.compile_refusal is not None:
            raise RuntimeError(self.compile_refusal)
        inner, records = self.recipe.op_state(forward=forward, num_gemms=num_gemms, tensors=tensors)
        return DebugState(self, inner, ()), records

    def merge_records(self, tensors: list[torch.Tensor], records: list[torch.Tensor]) -> None:
        self.recipe.merge_records(tensors, records)  # the scaling state is the wrapped recipe's
