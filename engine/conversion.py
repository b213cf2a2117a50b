"""engine.convert / engine.unconvert: an existing PyTorch or Hugging Face model on engine layers, and back.

`convert` swaps every `torch.nn.Linear` and `transformers.pytorch_utils.Conv1D` for an
`engine.Linear` in place, so the model runs its GEMMs in FP8 inside `fp8_autocast` and is
unchanged outside it; `unconvert` turns them back into torch layers so a checkpoint of the
converted model loads into the original model class.

Shapes: every recipe takes every layer shape. Dims that are not multiples of a block (1x128,
128x128, 1x32) end in a partial block stored compactly, and the CUDA per-tensor GEMM pads K and
N to multiples of 16, so `convert` never skips a layer for its shape. It skips layers
`engine.Linear` cannot stand in for: subclasses of nn.Linear / Conv1D (their forward may
differ, e.g. nn.MultiheadAttention's out_proj, whose weight the attention reads directly),
weights in a dtype other than float32/bfloat16/float16, empty dims, and tensor-subclass
weights (DTensor, already-quantized weights); one warning names them all.
"""

from __future__ import annotations

import warnings
from typing import Callable

from torch import nn

from engine.checks import check_bool, check_instance
from engine.modules import FP8Module, LayerNormLinear, Linear
from engine.modules.experts import GroupedExperts
from engine.modules.recipe_maps import saved_recipe_map, set_recipe_map
from engine.ops.reference import HIGH_PRECISION_DTYPES
from engine.recipes import DelayedScaling, Recipe, RecipeMap
from engine.recipes.recipe_map import as_recipe_map
from engine import conversion_experts as experts
from engine import conversion_layers as layers

ModuleFilter = Callable[[str, nn.Module], bool]
NORMS = (nn.LayerNorm, nn.RMSNorm)


def convert(
    model: nn.Module,
    *,
    module_filter: ModuleFilter | None = None,
    keep_output_head: bool = True,
    fp8_weights: bool = False,
    recipe: Recipe | None = None,
    fuse_norms: bool = False,
    recipe_map: RecipeMap | dict | None = None,
) -> nn.Module:
    """Replace the model's nn.Linear and Conv1D layers with engine.Linear, and the experts of Hugging Face
    mixture-of-experts models (Qwen2-MoE, Mixtral, Qwen3-MoE, OLMoE) with engine.GroupedExperts, in place;
    returns the model. Their routers stay in high precision.

    Each converted layer keeps its Parameter objects (values bit for bit, dtype, device,
    `requires_grad`, `main_grad`, ties) and its training mode, and state_dict keys stay the
    same, so an existing checkpoint loads. Outside fp8_autocast the model computes what it did.

    * `module_filter(fqn, module) -> bool`: convert only layers for which it returns True.
    * `keep_output_head` (default True): leave the output head in high precision - the module
      `model.get_output_embeddings()` returns (Hugging Face), else the last Linear/Conv1D.
      A converted head tied to the input embedding keeps sharing its Parameter.
    * `fp8_weights`: FP8 primary weights (`fp8_model_init` semantics) quantized by `recipe`'s
      weight quantizer (default DelayedScaling()); values then change by the FP8 rounding.
      A weight tied to another module stays high precision (one warning names it).
    * `recipe`: the recipe FP8 primary weights are made for (only with `fp8_weights=True`, else a
      ValueError: the recipe a model computes under is the fp8_autocast's, as in Transformer Engine).
      Every recipe takes every layer shape (module docstring), so it excludes no layer.
    * `fuse_norms`: inside nn.Sequential, a LayerNorm/RMSNorm directly followed by a converted
      nn.Linear of its size becomes one engine.LayerNormLinear at the Linear's index (an
      nn.Identity stays at the norm's); the norm's keys move to `<linear>.layer_norm_weight`
      / `.layer_norm_bias` (unconvert moves them back). Norms whose output feeds the Linear
      through forward code (Hugging Face models) are not fused: module structure does not
      show the data flow.

    * `recipe_map`: per-layer recipes (`engine.recipes.RecipeMap`, or a dict of fnmatch patterns to a
      recipe or None for high precision), stored in the converted modules as `engine.set_recipe_map`
      does: saved with the model, used under any fp8_autocast that does not bring a map of its own.
      Without it, the map a Hugging Face model's config carries (`config.engine_recipe_map`, saved by
      `save_pretrained` after `engine.set_recipe_map`) is applied.

    Every engine module of the converted model is named after `model.named_modules()` (`module.name`),
    so `fp8_autocast(recipe=RecipeMap(...))` can match it.

    Conv1D weights are held as [out, in] (a transposed copy) but saved and loaded in Conv1D's
    [in, out] layout, so GPT-2 checkpoints load both ways; with `fp8_weights` such a weight is
    saved dequantized and requantized when loaded. A bare layer (`model` itself a Linear) is
    returned converted: use the return value.
    """
    model, module_filter = _check_model(model), _check_filter(module_filter)
    check_bool(keep_output_head, "keep_output_head")
    check_bool(fp8_weights, "fp8_weights")
    check_bool(fuse_norms, "fuse_norms")
    check_instance(recipe, Recipe, "recipe", "an engine.recipes.Recipe or None", none_ok=True)
    recipe_map = None if recipe_map is None else as_recipe_map(recipe_map, "recipe_map")
    if recipe is not None and not fp8_weights:
        raise ValueError(f"recipe: {type(recipe).__name__}(...) given without fp8_weights=True; convert uses a recipe "
                         "only to quantize FP8 primary weights. A converted model computes in FP8 inside "
                         "engine.fp8_autocast(recipe=...), as Transformer Engine's modules do, and as before outside "
                         "it: drop recipe= and run the model under engine.fp8_autocast(recipe=...), or pass "
                         "fp8_weights=True for FP8 primary weights quantized by it")
    fp8_recipe = (recipe if recipe is not None else DelayedScaling()) if fp8_weights else None
    head = _output_head(model) if keep_output_head else None
    tied = _tied_parameters(model)
    skipped: dict[str, str] = {}
    tied_names: list[str] = []
    kinds: dict[int, tuple[nn.Module, str | None]] = {}  # holds the module: a freed one's id could be reused

    def chosen(fqn: str, module: nn.Module) -> str | None:
        """The layer's kind if it is to be converted (asked once per layer); records why a layer is skipped."""
        if id(module) not in kinds:
            kinds[id(module)] = (module, _kind_to_convert(fqn, module))
        return kinds[id(module)][1]

    moe = any(experts.is_hf_experts(m) for m in model.modules())

    def _kind_to_convert(fqn: str, module: nn.Module) -> str | None:
        if not layers.is_linear_like(module) or module is head:
            return None
        if moe and fqn.rsplit(".", 1)[-1] in experts.ROUTER_NAMES:  # a mixture of experts' router: high precision
            return None
        if module_filter is not None and not _filter_says(module_filter, fqn, module):
            return None
        reason = _why_not(module, fp8_weights)
        if reason is not None:
            skipped[fqn] = reason
            return None
        return layers.layer_kind(module)

    def weight_recipe(fqn: str, module: nn.Module) -> Recipe | None:
        if fp8_recipe is not None and id(module.weight) in tied:
            tied_names.append(fqn)
            return None
        return fp8_recipe

    def replacement(fqn: str, module: nn.Module) -> nn.Module | None:
        if experts.is_hf_experts(module):
            return experts_replacement(fqn, module)
        kind = chosen(fqn, module)
        return None if kind is None else layers.to_engine_linear(module, kind, weight_recipe(fqn, module))

    def experts_replacement(fqn: str, module: nn.Module) -> nn.Module | None:
        if module_filter is not None and not _filter_says(module_filter, fqn, module):
            return None
        reason = experts.why_not_experts(module, fp8_weights)
        if reason is not None:
            skipped[fqn] = reason
            return None
        return experts.to_grouped_experts(module)

    if fuse_norms and not _fuse_sequential_norms(model, chosen, weight_recipe):
        warnings.warn("engine.convert: fuse_norms found no LayerNorm/RMSNorm directly followed by a converted "
                      "nn.Linear inside an nn.Sequential; nothing was fused (a norm applied in forward code, as in "
                      "Hugging Face models, cannot be fused from the module structure)", UserWarning, stacklevel=2)
    model = _replace(model, replacement)
    if skipped:
        listed = "; ".join(f"{name} ({why})" for name, why in skipped.items())
        warnings.warn(f"engine.convert: {len(skipped)} layer(s) stay torch layers: {listed}", UserWarning, stacklevel=2)
    if tied_names:
        warnings.warn(f"engine.convert: fp8_weights: {', '.join(tied_names)} keep(s) a high-precision weight: it is "
                      "tied to another module's parameter, and a shared weight cannot be an FP8 primary weight",
                      UserWarning, stacklevel=2)
    recipe_map = saved_recipe_map(model) if recipe_map is None else recipe_map
    if recipe_map is not None:
        return set_recipe_map(model, recipe_map)
    for name, module in model.named_modules():
        if isinstance(module, FP8Module):
            module.name = name
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """The inverse of convert, in place: each engine.Linear becomes an nn.Linear (or the Conv1D it came
    from) and each LayerNormLinear that convert fused becomes its norm and nn.Linear again; returns the model.

    Parameters are kept (FP8 primary weights dequantized into new ones), so the model's
    state_dict loads strictly into the original model class. FP8 scaling state is dropped.
    Layers torch cannot express (`return_bias` or `fuse_wgrad_accumulation` on) stay, with a
    warning naming them; LayerNormLinear and LayerNormMLP layers convert did not make stay too.
    """
    model = _check_model(model)
    skipped: list[str] = []

    def replacement(fqn: str, module: nn.Module) -> nn.Module | None:
        if isinstance(module, GroupedExperts):
            return experts.to_hf_experts(module)
        if type(module) is not Linear:
            return None
        if module.return_bias or module.fuse_wgrad_accumulation:
            skipped.append(fqn)
            return None
        return layers.to_torch_layer(module)

    model = _replace(model, replacement)
    _split_sequential_norms(model)
    if skipped:
        warnings.warn(f"engine.unconvert: {', '.join(skipped)} stay engine.Linear: return_bias or "
                      "fuse_wgrad_accumulation has no torch.nn.Linear equivalent", UserWarning, stacklevel=2)
    return model


# ------------------------------------------------------------------ arguments
def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return model


def _check_filter(module_filter: object) -> ModuleFilter | None:
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"module_filter: expected a callable (fqn, module) -> bool or None, "
                        f"got {type(module_filter).__name__}")
    return module_filter


def _filter_says(module_filter: ModuleFilter, fqn: str, module: nn.Module) -> bool:
    answer = module_filter(fqn, module)
    if not isinstance(answer, bool):
        raise TypeError(f"module_filter: expected it to return a bool, got {answer!r} for {fqn!r}")
    return answer


# ------------------------------------------------------------------ which layers
def _why_not(module: nn.Module, fp8_weights: bool) -> str | None:
    """Why engine.Linear cannot stand in for `module`, or None if it can."""
    kind = layers.layer_kind(module)
    if kind is None:
        return f"{type(module).__qualname__} subclasses a torch layer and may compute differently"
    weight = module.weight
    if type(weight) is not nn.Parameter:
        return f"its weight is a {type(weight).__name__}; engine takes plain tensors"
    if weight.dtype not in HIGH_PRECISION_DTYPES:
        return f"{weight.dtype} weight; engine.Linear takes float32, bfloat16 or float16"
    if weight.numel() == 0:
        return f"empty weight of shape {tuple(weight.shape)}"
    if fp8_weights and weight.is_meta:
        return "fp8_weights needs weights with data, this one is on the meta device"
    return None


def _output_head(model: nn.Module) -> nn.Module | None:
    """model.get_output_embeddings() where the model has it (Hugging Face), else its last Linear/Conv1D."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except NotImplementedError:  # transformers' base class says so for a model without an output head
            pass
    last = None
    for module in model.modules():
        if layers.is_linear_like(module):
            last = module
    return last


def _tied_parameters(model: nn.Module) -> set[int]:
    """ids of Parameters registered in more than one module (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}


# ------------------------------------------------------------------ the walk
def _replace(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module | None]) -> nn.Module:
    """Swap every submodule (and the root) for `replacement(fqn, module)` where that is not None.
    A module registered in several places gets one replacement, used in all of them."""
    done: dict[int, tuple[nn.Module, nn.Module | None]] = {}  # holds the module: a freed one's id could be reused

    def swap(fqn: str, module: nn.Module) -> nn.Module | None:
        if id(module) not in done:
            done[id(module)] = (module, replacement(fqn, module))
        return done[id(module)][1]

    for parent_fqn, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):  # named_children() would hide a second registration
            if child is None:
                continue
            new = swap(f"{parent_fqn}.{name}" if parent_fqn else name, child)
            if new is not None:
                setattr(parent, name, new)
    root = swap("", model)
    return model if root is None else root


def _fuse_sequential_norms(model: nn.Module, chosen: Callable, weight_recipe: Callable) -> int:
    """norm -> nn.Linear pairs inside nn.Sequential, where the Linear is to be converted, become one
    LayerNormLinear at the Linear's index and an nn.Identity at the norm's. Returns how many."""
    fused = 0
    for seq_fqn, seq in [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Sequential)]:
        names = list(seq._modules)
        for first, second in zip(names, names[1:]):
            norm, linear = seq._modules[first], seq._modules[second]
            fqn = f"{seq_fqn}.{second}" if seq_fqn else second
            if not _fusible(norm, linear) or chosen(fqn, linear) != "linear":
                continue
            seq._modules[second] = layers.to_layernorm_linear(norm, linear, weight_recipe(fqn, linear))
            identity = nn.Identity()
            setattr(identity, layers.FUSED_AWAY, True)
            seq._modules[first] = identity
            fused += 1
    return fused


def _fusible(norm: nn.Module, linear: nn.Module) -> bool:
    """An affine LayerNorm/RMSNorm over the last dim, of the Linear's dtype, feeding an nn.Linear."""
    return (type(linear) is nn.Linear and type(norm) in NORMS and norm.elementwise_affine
            and tuple(norm.normalized_shape) == (linear.in_features,)
            and norm.weight.dtype == linear.weight.dtype)


def _split_sequential_norms(model: nn.Module) -> None:
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(seq._modules)
        for first, second in zip(names, names[1:]):
            placeholder, fused = seq._modules[first], seq._modules[second]
            if getattr(placeholder, layers.FUSED_AWAY, False) and isinstance(fused, LayerNormLinear) \
                    and hasattr(fused, layers.FUSED_NORM):
                seq._modules[first], seq._modules[second] = layers.split_layernorm_linear(fused)
