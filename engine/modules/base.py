"""What every engine module shares: recipe states, FP8 weights, checkpoint extra state.

A module keeps one forward and one backward `RecipeState` for the recipe it last ran
under (rebuilt when the recipe changes), registers them with fp8_autocast so delayed
scales update at the right moments, and saves its recipe and delayed-scaling state in
`_extra_state` as a uint8 record (no pickle; modules/saving.py) and FP8 primary weights as
plain component tensors (tensors/serialization.py). A checkpoint saved under one recipe
loads under another: the quantizers are rebuilt and FP8 primary weights requantized, with a
warning naming both.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from engine import autocast, recompute
from engine.dtensor import is_dtensor, local_of
from engine.formats import FP8_DTYPES
from engine.hooks import Hook
from engine.modules.linear_function import LinearArgs, WeightCache
from engine.modules.saving import CHOICE_KEY, EXTRA_STATE_KEY, encode_extra_state, read_extra_state
from engine.parameters import make_parameter
from engine.recipes import Recipe, RecipeMap, RecipeState, Role, recipe_from_plain, recipe_to_plain
from engine.recipes.recipe_map import choice_from_plain, choice_to_plain
from engine.recipes.base import SLOTS_PER_GEMM
from engine.recipes.debug_state import DebugState
from engine.tensors import QuantizedTensor
from engine.tensors.serialization import COMPONENT_SUFFIXES, META_SUFFIX, has_components, pop_components, to_components


#: FSDP2-sharded FP8 weights (DTensors over a quantized shard) as state-dict components, and back:
#: engine.distributed.state_dict, above this layer, registers them
SHARDED_COMPONENTS: Hook = Hook("FP8Module: the state-dict components of a sharded FP8 weight", "engine.distributed")
LOAD_SHARDED_COMPONENTS: Hook = Hook("FP8Module: loading a sharded FP8 weight's components", "engine.distributed")


def is_sharded_quantized(param: Any) -> bool:
    """A DTensor (FSDP2's sharded parameter) over an engine quantized tensor."""
    return is_dtensor(param) and isinstance(param._local_tensor, QuantizedTensor)


class ExtraStateError(ValueError):
    """A malformed `_extra_state`, named without the module's prefix (which only `_load_from_state_dict` knows)."""


class FP8Module(torch.nn.Module):
    """Base of Linear, LayerNormLinear and LayerNormMLP. Subclasses set `num_gemms` and `weight_names`."""

    num_gemms: int = 1
    weight_names: tuple[str, ...] = ("weight",)
    #: each GEMM's name, as a CustomRecipe's factory sees it (`QuantizerRole.name`)
    gemm_names: tuple[str, ...] = ("",)

    def __init__(self) -> None:
        super().__init__()
        self._recipe: Recipe | None = None
        self._fwd_state: RecipeState | None = None
        self._bwd_state: RecipeState | None = None
        self._pending_extra_state: dict | None = None
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        #: the module's name for a per-layer RecipeMap (Transformer Engine's `name`): engine.convert and
        #: engine.set_recipe_map set it to the name model.named_modules() gives
        self.name: str | None = None
        self._recipe_choice: tuple[Recipe | None] | None = None  # (a map's pick,), None = no pick of its own
        self._choice_key: str = ""  # the pick as a string compiled code guards on

    # ------------------------------------------------------------------ per-layer recipes
    def set_recipe_choice(self, choice: tuple[Recipe | None] | None) -> None:
        """Give this module a recipe of its own, `(recipe,)` or `(None,)` for high precision, used under
        any fp8_autocast without a RecipeMap and saved in its checkpoint; None removes it."""
        if choice is not None and not (isinstance(choice, tuple) and len(choice) == 1
                                       and (choice[0] is None or isinstance(choice[0], Recipe))):
            raise TypeError(f"choice: expected (an engine recipe,), (None,) or None, got {choice!r:.200}")
        self._recipe_choice = choice
        self._choice_key = "" if choice is None else ("high_precision" if choice[0] is None else choice[0].key)

    def recipe_in_force(self) -> Recipe | None:
        """The recipe this module runs under in the current fp8_autocast; None: high precision."""
        recipe = autocast.get_recipe()
        if isinstance(recipe, RecipeMap):
            if self.name is None:
                raise ValueError(f"{type(self).__name__}: fp8_autocast got a RecipeMap but this module has no name to "
                                 "match its patterns against; name every module with engine.set_recipe_map(model, "
                                 "recipe_map) or engine.convert(model), or set module.name")
            return recipe.recipe_for(self.name)
        return recipe if self._recipe_choice is None else self._recipe_choice[0]

    # ------------------------------------------------------------------ parameters
    def _new_weight(self, value: torch.Tensor, gemm: int) -> torch.nn.Parameter:
        """A weight parameter: quantized with this module's own weight quantizer under fp8_model_init."""
        if not autocast.is_fp8_model_init():
            return make_parameter(value, None)
        if self._fwd_state is None:
            self._build_states(autocast.model_init_recipe(), value.device)
        return make_parameter(value, self._primary_weight_quantizer(gemm))

    def _primary_weight_quantizer(self, gemm: int):
        """This module's weight quantizer, set to make both usages (fprop and dgrad read an FP8 weight)."""
        quantizer = self._fwd_state.quantizer(Role.WEIGHT, gemm)
        if quantizer is not None:
            quantizer.set_usage(rowwise=True, columnwise=True)
        return quantizer

    # ------------------------------------------------------------------ recipe states
    def _build_states(self, recipe: Recipe, device: torch.device) -> None:
        # states and requantized weights outlive this call: never make them inference tensors, or the
        # first training step after an eval under torch.inference_mode() could not update them
        with torch.inference_mode(False):
            self._build_states_now(recipe, device)

    def _build_states_now(self, recipe: Recipe, device: torch.device) -> None:
        old_recipe, old_fwd, old_bwd = self._recipe, self._fwd_state, self._bwd_state
        self._recipe = recipe
        who = {"module": type(self).__name__, "gemm_names": self.gemm_names}  # what a CustomRecipe's factory is told
        self._fwd_state = recipe.make_state(forward=True, num_gemms=self.num_gemms, device=device, **who)
        self._bwd_state = recipe.make_state(forward=False, num_gemms=self.num_gemms, device=device, **who)
        for state in (self._fwd_state, self._bwd_state):
            if isinstance(state, DebugState):  # names its dump files
                state.layer = self.name
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        if old_fwd is not None:  # keep what stateful scaling learned under the previous settings
            self._fwd_state.carry_from(old_fwd)
            self._bwd_state.carry_from(old_bwd)
        if self._pending_extra_state is not None:
            self._apply_extra_state(self._pending_extra_state)
        self._requantize_fp8_weights(old_recipe)

    def _requantize_fp8_weights(self, old_recipe: Recipe | None) -> None:
        """Give FP8 primary weights this recipe's weight quantizers (requantizing across schemes)."""
        for gemm, name in enumerate(self.weight_names):
            param = getattr(self, name, None)  # None while __init__ is still creating the weights
            if not isinstance(param, QuantizedTensor):
                continue
            quantizer = self._primary_weight_quantizer(gemm)
            if quantizer is None:  # this recipe keeps the weight in high precision: the FP8 one is read as is
                continue
            if param.qstorage.quantizer is not None and param.qstorage.quantizer.config() == quantizer.config():
                param.update_quantizer(quantizer)
                continue
            if old_recipe is not None:
                warnings.warn(f"{type(self).__name__}.{name}: FP8 weight quantized under {old_recipe!r} is "
                              f"requantized for {self._recipe!r}", UserWarning, stacklevel=4)
            with torch.no_grad():
                fresh = torch.nn.Parameter(quantizer.quantize(param.dequantize()), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, fresh)  # keeps the Parameter object the optimizer holds

    def _prepare(self, device: torch.device, is_first_microbatch: bool | None) -> list[LinearArgs]:
        """Per-GEMM arguments for this forward: FP8 or not, the states, and the autocast bookkeeping."""
        fp8, calibrating = autocast.is_fp8_enabled(), autocast.is_calibrating()
        grad = torch.is_grad_enabled()
        recompute.check_forward(self, fp8)
        # high precision, unless calibrating (states record amaxes while the GEMMs run in high precision)
        if not fp8 and not calibrating:
            return self._high_precision_args(grad)
        if torch.compiler.is_compiling():
            if not _states_while_tracing(self, autocast.get_recipe_key(), self._choice_key, device):
                return self._high_precision_args(grad)
        else:
            recipe = self.recipe_in_force()
            if recipe is None:  # a per-layer map keeps this layer in high precision
                return self._high_precision_args(grad)
            self._refuse_inference_weights("inside fp8_autocast" if fp8 else "while calibrating")
            if self._recipe is None or (recipe is not self._recipe and recipe != self._recipe):
                self._build_states(recipe, device)
        fwd = recompute.register_states(self._fwd_state, self._bwd_state, fp8=fp8, grad=grad)  # engine.checkpoint
        # the same arguments as the last call's unless something they hold changed: made once, not every step
        # (LinearArgs are never modified: wrappers make changed copies)
        key = (fp8, fwd, self._bwd_state, self._weight_caches, is_first_microbatch, self.fuse_wgrad_accumulation, grad)
        last = self.__dict__.get("_last_args")
        if last is not None and len(last[0]) == len(key) and all(a is b for a, b in zip(last[0], key)):
            return list(last[1])
        args = [
            LinearArgs(fp8=fp8, fwd=fwd, bwd=self._bwd_state, gemm=g, cache=self._weight_caches[g],
                       is_first_microbatch=is_first_microbatch, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                       grad_enabled=grad)
            for g in range(self.num_gemms)
        ]
        self.__dict__["_last_args"] = (key, tuple(args))
        return args

    def _high_precision_args(self, grad: bool) -> list[LinearArgs]:
        return [LinearArgs(fp8=False, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, grad_enabled=grad)
                for _ in range(self.num_gemms)]

    def _refuse_inference_weights(self, where: str) -> None:
        """A weight `engine.quantize_` swapped (a QuantizedWeight, which says `inference_only`) runs its own GEMM,
        on the high-precision path only."""
        for name in self.weight_names:
            weight = self._parameters.get(name)  # where a registered weight is (getattr: Module.__getattr__)
            if type(weight) is torch.nn.Parameter:  # a plain parameter (what training holds): no such weight
                continue
            if weight is None:
                weight = getattr(self, name, None)
            if getattr(type(weight), "inference_only", False) is True:
                raise TypeError(f"{type(self).__name__}.{name}: a {type(weight).__name__} ({weight.config!r}) from "
                                f"engine.quantize_ is for inference outside fp8_autocast; got a forward {where} "
                                "(run the model with fp8_autocast(enabled=False), or load the unquantized weights "
                                "to train)")

    def _calibrate(self, args: LinearArgs, inp: torch.Tensor, weight: torch.Tensor) -> None:
        """Record the input and weight amaxes of one GEMM while running in high precision."""
        if args.fp8 or args.fwd is None:
            return
        w = weight.dequantize() if isinstance(weight, QuantizedTensor) else local_of(weight)
        inp = local_of(inp)  # a DTensor's shard: the amaxes are reduced over fp8_group before the update
        args.fwd.record_amax(args.fwd.slot(Role.INPUT, args.gemm), inp)
        args.fwd.record_amax(args.fwd.slot(Role.WEIGHT, args.gemm), w)

    # ------------------------------------------------------------------ checkpoints
    def __getattr__(self, name: str) -> Any:
        """Parameters and submodules as torch finds them; also an FP8 weight's state-dict component keys
        (`weight_scale_inv`, `weight_quantization`, ...), which torch.distributed.checkpoint looks up."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            for suffix in (*[s for s in COMPONENT_SUFFIXES.values() if s], META_SUFFIX):
                param = self._parameters.get(name[: -len(suffix)]) if name.endswith(suffix) else None
                if isinstance(param, QuantizedTensor):
                    return to_components(name[: -len(suffix)], param)[name]
                if param is not None and is_sharded_quantized(param):
                    return SHARDED_COMPONENTS(name[: -len(suffix)], param)[name]
            raise

    def get_extra_state(self) -> torch.Tensor:
        """The recipe and, for delayed scaling, scales and amax histories, as a uint8 record (see modules/saving.py).

        Empty when the module has no recipe (never ran); `state_dict()` then leaves the key out.
        """
        choice = {} if self._recipe_choice is None else {CHOICE_KEY: choice_to_plain(self._recipe_choice[0])}
        if self._recipe is None and self._pending_extra_state is not None:
            return encode_extra_state({**self._pending_extra_state, **choice})  # loaded, not run yet: pass it on
        if self._recipe is None:
            return encode_extra_state({"recipe": None, **choice}) if choice else torch.empty(0, dtype=torch.uint8)
        state: dict[str, Any] = {"recipe": recipe_to_plain(self._recipe), **choice}
        for key, s in (("forward", self._fwd_state), ("backward", self._bwd_state)):
            part = s.to_plain()
            if part is not None:
                state[key] = part
        return encode_extra_state(state)

    def set_extra_state(self, state: Any) -> None:
        """Validate a saved state now (whether or not this module has run); apply it when states exist."""
        try:
            plain = read_extra_state(state)
            if plain is None:
                return
            choice = check_extra_state(plain, self.num_gemms)[1]
        except ValueError as err:  # `_load_from_state_dict` puts the module's prefix before the key
            raise ExtraStateError(str(err)) from None
        if CHOICE_KEY in plain:
            self.set_recipe_choice(choice)
            plain = {k: v for k, v in plain.items() if k != CHOICE_KEY}
        if plain["recipe"] is None:
            return
        self._pending_extra_state = plain
        if self._recipe is not None:
            self._apply_extra_state(plain)

    def _apply_extra_state(self, state: dict) -> None:
        saved_recipe = recipe_from_plain(state["recipe"])
        self._pending_extra_state = None
        if saved_recipe.key != self._recipe.key:  # as saved: a callable by its name (all a checkpoint keeps)
            warnings.warn(f"{type(self).__name__}: checkpoint was saved under {saved_recipe!r} and is loaded "
                          f"under {self._recipe!r}; quantizers are rebuilt for the new recipe",
                          UserWarning, stacklevel=4)
        if type(saved_recipe) is not type(self._recipe):
            return  # another kind of scaling: its state means nothing here
        for key, s in (("forward", self._fwd_state), ("backward", self._bwd_state)):
            if key in state:
                s.load_plain(state[key])

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """No `_extra_state` key without state; FP8 weights as plain component tensors (unless keep_vars)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        extra = destination.get(prefix + EXTRA_STATE_KEY)
        if isinstance(extra, torch.Tensor) and extra.numel() == 0:
            del destination[prefix + EXTRA_STATE_KEY]
        if keep_vars:  # the live Parameters were asked for
            return
        for name, param in self._parameters.items():
            if isinstance(param, QuantizedTensor) or is_sharded_quantized(param):
                components = (to_components(prefix + name, param) if isinstance(param, QuantizedTensor)
                              else SHARDED_COMPONENTS(prefix + name, param))
                clash = sorted(k for k in components if k in destination and k != prefix + name)
                if clash:
                    raise ValueError(f"{clash[0]}: the FP8 weight {prefix}{name} is saved under this key, "
                                     "which another entry of the state dict already has")
                if prefix + name not in components:
                    del destination[prefix + name]
                destination.update(components)  # the data keeps the parameter's key and place

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # FP8 weights saved as component keys become quantized tensors again (torch.load_state_dict
        # hands each module its own copy of the state dict, so the keys are replaced in place)
        for name, param in self._parameters.items():
            key = prefix + name
            if has_components(state_dict, key) and is_sharded_quantized(param):  # FSDP2's shard: copied in place
                LOAD_SHARDED_COMPONENTS(state_dict, key, param)
                state_dict[key] = param
            elif has_components(state_dict, key):
                storage, saved_quantizer = pop_components(state_dict, key)
                state_dict[key] = QuantizedTensor.wrap(storage)
                mine = param.quantizer if isinstance(param, QuantizedTensor) else None
                if mine is not None and saved_quantizer is not None \
                        and saved_quantizer != {"class": type(mine).__name__, "config": mine.config()}:
                    state_dict[key] = storage.dequantize()  # quantized otherwise: copy_ requantizes with mine
            elif isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].dtype in FP8_DTYPES:
                raise ValueError(f"{key}: a {state_dict[key].dtype} tensor without its scales: the key "
                                 f"{key}{META_SUFFIX} that says how it was quantized is missing")
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        except ExtraStateError as err:  # name the key the bad extra state came from (other errors name theirs)
            raise ValueError(f"{prefix}{err}") from None
        missing_keys = args[2] if len(args) > 2 else kwargs.get("missing_keys")
        key = prefix + EXTRA_STATE_KEY
        if key not in state_dict and missing_keys is not None and key in missing_keys:
            missing_keys.remove(key)  # a checkpoint of a plain torch module has no FP8 state: that is fine
        self._attach_weight_quantizers()

    def _attach_weight_quantizers(self) -> None:
        """An FP8 weight loaded without a quantizer (`assign=True`) gets this module's, if the scheme matches."""
        if self._fwd_state is None:
            return
        for gemm, name in enumerate(self.weight_names):
            param = getattr(self, name, None)
            if isinstance(param, QuantizedTensor) and param.quantizer is None:
                quantizer = self._primary_weight_quantizer(gemm)
                if quantizer is not None and quantizer.scheme == param.scheme:
                    param.update_quantizer(quantizer)


def _states_while_tracing(module: FP8Module, recipe_key: str, choice_key: str, device: torch.device) -> bool:
    """States for the recipe the module runs under, made by Dynamo while it traces (eagerly, outside the graph),
    before the traced code reads them: the first compiled step's guards already see them, so the second step
    does not recompile. The autocast's recipe key and the module's pick (strings Dynamo guards on) make a new
    recipe or map retrace. False: this module runs in high precision (a per-layer map's pick)."""
    recipe = module.recipe_in_force()
    if recipe is None:
        return False
    if module._fwd_state is None or module._fwd_state.key != recipe.key:
        module._build_states(recipe, device)
    return True


# What `torch.compiler.assume_constant_result` does (Dynamo runs the function while tracing and
# keeps its result as a constant), without importing torch._dynamo with engine: that import
# takes ~2.5 s, as long as torch's own. tests/test_compile.py checks the two agree.
_states_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


def check_extra_state(state: dict[str, Any], num_gemms: int) -> tuple[Recipe | None, tuple[Recipe | None] | None]:
    """The saved recipe (None: the module never ran) and the module's own pick ((recipe or None,), or None
    without one), after checking every part of a plain `_extra_state`; ValueError naming the bad key."""
    choice = None
    if CHOICE_KEY in state:
        try:
            choice = (choice_from_plain(state[CHOICE_KEY]),)
        except ValueError as err:
            raise ValueError(f"_extra_state[{CHOICE_KEY!r}]: {err}") from None
    if state["recipe"] is None:
        return None, choice
    try:
        recipe = recipe_from_plain(state["recipe"])
    except ValueError as err:
        raise ValueError(f"_extra_state['recipe']: {err}") from None
    for key, slots in (("forward", SLOTS_PER_GEMM[True] * num_gemms), ("backward", SLOTS_PER_GEMM[False] * num_gemms)):
        recipe.check_saved_state(state.get(key), f"_extra_state[{key!r}]", slots)
    return recipe, choice
