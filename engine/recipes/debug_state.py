"""DebugState: a `Debug` recipe's state - the wrapped recipe's state, with the switched GEMMs' quantizers replaced.

Scaling state (delayed scaling's amax history, stochastic-rounding counters, checkpoints) stays the wrapped
state's: every hook is passed on to it. Only the quantizers handed to the layer differ (`engine.recipes.debug`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.recipes.base import RecipeState
from engine.recipes.operands import Gemm, Role, operand_key

#: the `saved_schemes` entry of an operand a forward saves for backward as the plain, dequantized tensor of a
#: fake quantization (the compiled ops save and restore it as one tensor)
DEQUANTIZED = "dequantized"


class DebugQuantizer:
    """A quantizer whose output is dequantized (fake quantization) and/or dumped at one call; everything else is
    the wrapped quantizer's (usages set on this object are set on it)."""

    def __init__(self, quantizer: Any, *, fake: bool, dump: tuple[Path, int] | None, name: Any) -> None:
        fields = {"_inner": quantizer, "_fake": fake, "_dump": dump, "_name": name, "_calls": 0}
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    def quantize_storage(self, x: torch.Tensor) -> Any:
        storage = self._inner.quantize_storage(x)
        call = self._calls
        object.__setattr__(self, "_calls", call + 1)
        if self._dump is not None and call == self._dump[1]:
            self._write(x, storage, call)
        if self._fake:  # one usage per call (DebugState gives each use its own DebugQuantizer)
            return storage.dequantize()
        return storage

    def _write(self, x: torch.Tensor, storage: Any, call: int) -> None:
        from safetensors.torch import save_file

        tensors = {"input": x.detach()}
        if storage.has_rowwise:
            tensors["rowwise"] = storage.dequantize()
        if storage.has_columnwise:
            tensors["columnwise"] = storage.without_rowwise().dequantize()
        directory = self._dump[0]
        directory.mkdir(parents=True, exist_ok=True)
        plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(plain, str(directory / f"{self._name()}.step{call}.safetensors"))

    def copy(self) -> DebugQuantizer:
        """A copy wrapping a copy of the wrapped quantizer (the compiled ops copy those that advance a counter)."""
        return DebugQuantizer(self._inner.copy(), fake=self._fake, dump=self._dump, name=self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # quantize_uses sets the usages on the quantizer
        setattr(self._inner, name, value)


class DebugState(RecipeState):
    """The quantizers of `inner` (the wrapped recipe's state) with the Debug recipe's switches applied."""

    def __init__(self, recipe: Any, inner: RecipeState, gemm_names: tuple[str, ...]) -> None:
        self.inner = inner
        #: the layer's name in dump files (FP8Module sets it to module.name when it builds its states)
        self.layer: str | None = None
        shared: dict[tuple[int, int], Any] = {}  # one replacement per replaced quantizer object and GEMM
        quantizers = {}
        dump = None if recipe.dump_dir is None else (Path(recipe.dump_dir), recipe.dump_step)
        for (op, gemm), q in inner._quantizers.items():
            use = op[0].value
            if use in recipe.high_precision:
                quantizers[op, gemm] = None
                continue
            if use in recipe.current_scaling and q is not None:
                key = (id(q), gemm)
                if key not in shared:
                    shared[key] = recipe.current_spec(op[1]).make()
                q = shared[key]
            if q is not None and (dump is not None or use in recipe.fake_quantize):
                fake = use in recipe.fake_quantize
                key = (id(q), -1 - gemm)
                where = "" if gemm >= len(gemm_names) or not gemm_names[gemm] else f".{gemm_names[gemm]}"
                if fake or key not in shared:  # a fake quantizer dequantizes one usage: one per use
                    wrapped = DebugQuantizer(q, fake=fake, dump=dump, name=_Name(self, where))
                    if not fake:
                        shared[key] = wrapped
                q = wrapped if fake else shared[key]
                q._name.operands.append(op)
            quantizers[op, gemm] = q
        super().__init__(recipe, inner.forward, inner.num_gemms, quantizers)
        saved_uses = ((Gemm.WGRAD, Role.INPUT), (Gemm.DGRAD, Role.WEIGHT))
        self.saved_schemes = [tuple(DEQUANTIZED if getattr(quantizers.get((use, g)), "_fake", False) else scheme
                                    for use, scheme in zip(saved_uses, schemes))
                              for g, schemes in enumerate(self.saved_schemes)]
        self.rng_counters = inner.rng_counters
        self.op_records = inner.op_records  # the compiled ops return the wrapped state's scaling records
        self.compile_refusal = recipe.compile_refusal

    # ------------------------------------------------------------------ the wrapped state's scaling state
    def op_tensors(self) -> list[torch.Tensor]:
        return self.inner.op_tensors()

    def merge_records(self, records: list[torch.Tensor]) -> None:
        self.inner.merge_records(records)

    def record_amax(self, slot: int, x: torch.Tensor) -> None:
        self.inner.record_amax(slot, x)

    def amaxes_to_reduce(self) -> list[torch.Tensor]:
        return self.inner.amaxes_to_reduce()

    def update(self) -> None:
        self.inner.update()

    def to_plain(self) -> dict[str, torch.Tensor] | None:
        return self.inner.to_plain()

    def load_plain(self, part: dict[str, torch.Tensor]) -> None:
        self.inner.load_plain(part)

    def carry_from(self, old: RecipeState) -> None:
        self.inner.carry_from(old.inner if isinstance(old, DebugState) else old)

    def replay_copy(self) -> RecipeState:
        twin = self.inner.replay_copy()
        if twin is self.inner:
            return self
        copy = DebugState(self.recipe, twin, ())
        copy.layer = self.layer
        return copy

    def __getattr__(self, name: str) -> Any:  # what a wrapped state has beyond RecipeState's (current_amax, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Name:
    """A dump file's stem, read when the file is written (the layer's name is set after the state is made): the
    operand ("fprop_input") of a quantizer one use has, the tensor ("input") of one both uses share."""

    def __init__(self, state: DebugState, where: str) -> None:
        self.state, self.where, self.operands = state, where, []

    def __call__(self) -> str:
        what = operand_key(self.operands[0]) if len(self.operands) == 1 else self.operands[0][1].value
        return f"{self.state.layer or 'layer'}{self.where}.{what}"
