"""The inference quantization configs: frozen, validated choices of how a Linear's weight is stored and run.

Each config is a frozen dataclass (hashable, comparable, plain data in checkpoints via
`to_plain` / `config_from_plain`). What a config *does* (quantize a weight into parts,
dequantize, run the linear) lives with its format in `int_formats.py` / `engine_formats.py`;
`format_of(config)` finds it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from engine.checks import check_instance
from engine.schemes import INT4_GROUP_SIZES  # (re-exported: the group sizes are the int4 schemes')

#: every config class by name (what a checkpoint record names)
CONFIGS: dict[str, type[InferenceConfig]] = {}

MX_ELEMENTS = ("e4m3", "e2m3", "e3m2", "e2m1")
FLOAT8_GRANULARITIES = ("tensor", "row")
MX_SCALE_MODES = ("rceil", "floor")


@dataclass(frozen=True)
class InferenceConfig:
    """Base of the configs `engine.quantize_` takes."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        CONFIGS[cls.__name__] = cls

    def to_plain(self) -> dict[str, Any]:
        return {"name": type(self).__name__, **asdict(self)}


def _choice(value: Any, choices: tuple, name: str) -> None:
    """A TypeError for a value of another type than the choices' (128.0, True and "128" are not 128), a
    ValueError for a value that is none of them."""
    kind = type(choices[0])
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{name}: expected one of {list(choices)} (type {kind.__name__}), got {value!r} "
                        f"(type {type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class Int8WeightOnly(InferenceConfig):
    """Per-output-channel symmetric int8 weights: scale = amax/127 per row (stored in the weight's dtype for
    bf16 weights, fp32 otherwise), q = round-half-to-even(w / scale) clamped to [-127, 127].
    y = (x @ q^T) * scale, fp32 accumulation, rounded once to x.dtype, then + bias."""


@dataclass(frozen=True)
class Int4WeightOnly(InferenceConfig):
    """Asymmetric groupwise int4 (two codes a byte along K, engine's C++ GEMV/GEMM at small M): w ~ (q - 8) *
    scale + zero per group of `group_size` along K, scale and zero in bf16 (zero in the float domain), q in [0, 15]."""

    group_size: int = 128

    def __post_init__(self) -> None:
        _choice(self.group_size, INT4_GROUP_SIZES, "group_size")


@dataclass(frozen=True)
class Int8DynamicActivationInt8Weight(InferenceConfig):
    """Per-token symmetric int8 activations quantized at run time, per-channel int8 weights; the GEMM in int8
    with exact int32 accumulation, rescaled by both scales to x.dtype."""


@dataclass(frozen=True)
class Float8WeightOnly(InferenceConfig):
    """Per-channel E4M3 weights with power-of-2 scales (engine's Float8RowwiseQuantizer): exact in bf16."""


@dataclass(frozen=True)
class Float8DynamicActivationFloat8Weight(InferenceConfig):
    """E4M3 activations (quantized per call) and weights, per tensor (current scaling) or per row (rowwise);
    the GEMM is engine's exact `general_gemm`."""

    granularity: str = "tensor"

    def __post_init__(self) -> None:
        _choice(self.granularity, FLOAT8_GRANULARITIES, "granularity")


@dataclass(frozen=True)
class MXWeightOnly(InferenceConfig):
    """OCP MX weights (1x32 blocks, E8M0 scales) by engine's MXQuantizer; engine's C++ GEMV/GEMM at small M."""

    element: str = "e4m3"
    scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        _choice(self.element, MX_ELEMENTS, "element")
        _choice(self.scale_mode, MX_SCALE_MODES, "scale_mode")


@dataclass(frozen=True)
class NVFP4WeightOnly(InferenceConfig):
    """NVFP4 weights (E2M1 per 1x16 block, E4M3 block scales, one fp32 amax) by engine's NVFP4Quantizer."""


def config_from_plain(plain: Any, where: str = "config") -> InferenceConfig:
    """Inverse of `to_plain`; anything else is a ValueError naming `where`."""
    if not isinstance(plain, dict) or not isinstance(plain.get("name"), str) or plain["name"] not in CONFIGS:
        raise ValueError(f"{where}: expected a dict naming one of {sorted(CONFIGS)}, got {plain!r:.200}")
    cls = CONFIGS[plain["name"]]
    kwargs = {k: v for k, v in plain.items() if k != "name"}
    names = {f.name for f in fields(cls)}
    if set(kwargs) != names:
        raise ValueError(f"{where}: {cls.__name__} has the fields {sorted(names)}, got {sorted(kwargs)}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # a field's value: the config's own check names the field
        raise ValueError(f"{where}: {err}") from None


def check_config(config: Any, name: str = "config") -> InferenceConfig:
    check_instance(config, InferenceConfig, name, f"one of {', '.join(sorted(CONFIGS))} (engine.inference)")
    if type(config) not in CONFIGS.values():
        raise TypeError(f"{name}: expected one of {', '.join(sorted(CONFIGS))} (engine.inference), "
                        f"got {type(config).__name__}: {config!r:.100}")
    return config
