"""What engine's optimizers share: per-state formats in the param groups, encoded states, loading a state dict
saved with other formats (or by torch.optim), and the bytes the states take."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from engine.optim import formats, sharded, weights
from engine.optim.formats import StateFormat

StateDtype = str | StateFormat | Mapping[str, str | StateFormat]


def normalize_state_dtype(value: StateDtype, names: tuple[str, ...]) -> dict[str, str]:
    """`state_dtype` as {state name: format name} (plain data: param groups are saved as they are)."""
    if isinstance(value, Mapping):
        unknown = set(value) - set(names)
        if unknown:
            raise ValueError(f"state_dtype: unknown state(s) {sorted(unknown)}; this optimizer keeps {list(names)}")
        return {n: formats.parse(value.get(n, "fp32"), f"state_dtype[{n!r}]").name for n in names}
    name = formats.parse(value).name
    return {n: name for n in names}


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """A torch Optimizer whose states (`STATES`) are stored per group in `state_dtype` formats."""

    STATES: tuple[str, ...] = ()
    SECOND_MOMENTS: tuple[str, ...] = ()  # stored as sqrt in the blocked formats

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        defaults["state_dtype"] = normalize_state_dtype(defaults["state_dtype"], self.STATES)
        defaults["weights"] = weights.check_mode(defaults["weights"])
        super().__init__(params, defaults)
        for group in self.param_groups:  # a group's own state_dtype, given in a dict
            group["state_dtype"] = normalize_state_dtype(group["state_dtype"], self.STATES)
            group["weights"] = weights.check_mode(group["weights"])

    # -------------------------------------------------------------------------- states
    def format_of(self, group: dict, name: str) -> StateFormat:
        return formats.parse(group["state_dtype"][name])

    def all_fp32(self, group: dict) -> bool:
        return all(self.format_of(group, n).kind == "fp32" for n in self.STATES)

    def store(self, state: dict, group: dict, name: str, value: torch.Tensor, counter: torch.Tensor | None) -> None:
        """Encode fp32 `value` into state[name] (and state[name + '_scale'])."""
        fmt = self.format_of(group, name)
        sqrt = fmt.stores_sqrt(name in self.SECOND_MOMENTS)
        data, scale = formats.encode(fmt, formats.sqrt_rn(value) if sqrt else value, counter, signed=name not in self.SECOND_MOMENTS)
        if fmt.stochastic:
            formats_advance(counter, state.get(sharded.GLOBAL_NUMEL, value.numel()))
        state[name] = data
        if scale is not None:
            state[name + "_scale"] = scale
        else:
            state.pop(name + "_scale", None)

    def load(self, state: dict, group: dict, name: str, fmt: StateFormat | None = None) -> torch.Tensor:
        """The fp32 value of state[name] (decoded from `fmt`, default the group's)."""
        fmt = fmt or self.format_of(group, name)
        second = name in self.SECOND_MOMENTS
        value = formats.decode(fmt, state[name], state.get(name + "_scale"), signed=not second)
        return value * value if fmt.stores_sqrt(second) else value

    def stored_root(self, state: dict, group: dict, name: str) -> torch.Tensor:
        """sqrt of a second moment as stored: the stored value itself in the sqrt form, else sqrt(decode)."""
        fmt = self.format_of(group, name)
        if fmt.stores_sqrt(True):
            return formats.decode(fmt, state[name], state.get(name + "_scale"), signed=False)
        return formats.sqrt_rn(self.load(state, group, name))

    def blocks(self, group: dict) -> dict[str, int]:
        """{state name: elements per block} of the group's formats (0: not blocked)."""
        return {n: self.format_of(group, n).block for n in self.STATES}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        """One step of every group: its parameters that have a gradient (this rank's shards under FSDP2), their
        states made on first use, then the optimizer's `step_group(group, params)` on them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            live = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            with sharded.local_params(self, group, [p for _, p in live]) as local:
                for (i, _), p in zip(live, local):
                    self.init_if_needed(p, group, i)
                self.step_group(group, list(local))
        return loss

    def init_if_needed(self, p: torch.Tensor, group: dict, index: int) -> None:
        """`init_states` on the first step of p (or of its local shard: counters then start at its position)."""
        state = self.state[p]
        if sharded.has_states(state):
            return
        self.init_states(p, state, group, index)
        for key in sharded.COUNTERS:
            if key in state:
                state[key][1:].add_(state.get(sharded.SHARD_OFFSET, 0))

    def init_states(self, p: torch.Tensor, state: dict, group: dict, index: int) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if any(self.format_of(group, n).stochastic for n in self.STATES):
            state["state_counter"] = torch.tensor([group.get("seed", 0) * 65537 + index, 0], dtype=torch.int64)
        for name in self.STATES:
            self.store(state, group, name, torch.zeros(p.shape, dtype=torch.float32), state.get("state_counter"))
        weights.init_state(p, group["weights"], state, seed=group.get("seed", 0) * 65537 + index + (1 << 20))

    # -------------------------------------------------------------------------- loading across formats
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved with any state formats (or by torch.optim): each state is decoded from the
        saved group's `state_dtype` (fp32 when absent) and re-encoded in this optimizer's (kept as saved when
        the formats agree). The saved tensors keep their dtypes (torch's loader would cast them to the
        parameter's)."""
        mine = [(dict(g["state_dtype"]), g["weights"]) for g in self.param_groups]
        saved_groups = state_dict["param_groups"]
        saved = [dict(g.get("state_dtype", {})) for g in saved_groups]
        by_id = {i: p for g_old, g in zip(saved_groups, self.param_groups) for i, p in zip(g_old["params"], g["params"])}
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for old_id, p in by_id.items():
            if old_id in saved_state:
                self.state[p] = {k: (v.detach().to(p.device, copy=True) if isinstance(v, torch.Tensor) else v)
                                 for k, v in saved_state[old_id].items()}
        for group, (dtypes, mode), old in zip(self.param_groups, mine, saved):
            group["state_dtype"], group["weights"] = dtypes, mode
            for index, p in enumerate(group["params"]):
                state = self.state.get(p)
                if not state:
                    continue
                view = sharded.unwrap(p, state) if sharded.is_sharded(p) else state
                self._reencode(sharded.local(p), view, group, old, mode, index)
                if view is not state:
                    self.state[p] = sharded.rewrap(p, view, self.blocks(group))

    def _reencode(self, p: torch.Tensor, state: dict, group: dict, old: dict, mode: str, index: int) -> None:
        """A loaded state (of p, or of its local shard) re-encoded from its saved formats `old` into the group's.
        The states `state_dict` wrote decoded to fp32 (blocked states of shards that are not whole blocks) are
        listed under DECODED and read as fp32. A tensor whose dtype is not its saved format's is refused
        (`check_loaded`): a DCP template of other formats than the checkpoint's gets its values cast."""
        start = state.get(sharded.SHARD_OFFSET, 0)
        decoded = tuple(state.pop(DECODED, ()))
        stochastic = any(self.format_of(group, n).stochastic for n in self.STATES)
        if stochastic and "state_counter" not in state:
            state["state_counter"] = torch.tensor([group.get("seed", 0) * 65537 + index, start], dtype=torch.int64)
        for name in self.STATES:
            if name not in state:
                continue
            source = formats.NAMES["fp32"] if name in decoded else formats.parse(old.get(name, "fp32"))
            check_loaded(state, name, source, old, index)
            if source == self.format_of(group, name):
                continue
            self.store(state, group, name, self.load(state, group, name, source), state.get("state_counter"))
        if not weights.in_place(p) and not any(k in state for k in ("master", "kahan", "sr_counter")):
            weights.init_state(p, mode, state, seed=group.get("seed", 0) * 65537 + index + (1 << 20))
            if "sr_counter" in state:
                state["sr_counter"][1:].add_(start)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; a blocked state of an FSDP2 shard whose blocks are not the whole tensor's
        (`sharded.aligned`) is written decoded to fp32 (its exact values) so that a checkpoint reshards."""
        out = super().state_dict()
        for group, packed in zip(self.param_groups, out["param_groups"]):
            for p, pid in zip(group["params"], packed["params"]):
                state = out["state"].get(pid)
                if not state or not sharded.is_sharded(p):
                    continue
                local_scales = [n for n in self.STATES if n + "_scale" in state
                                and not sharded.is_sharded(state[n + "_scale"])]
                if not local_scales:
                    continue
                view = sharded.unwrap(p, state)
                state = dict(state)
                for name in local_scales:
                    view[name] = self.load(view, group, name)
                    del view[name + "_scale"], state[name + "_scale"]
                    state[name] = sharded.rewrap(p, {name: view[name]}, {})[name]
                state[DECODED] = list(local_scales)
                out["state"][pid] = state
        return out

    # -------------------------------------------------------------------------- reports
    def state_bytes(self) -> int:
        """Bytes of every state tensor except the step counters and random-bit counters (masters included); of
        this rank's shards under FSDP2."""
        total = 0
        for state in self.state.values():
            for key, t in state.items():
                t = sharded.local(t)
                if isinstance(t, torch.Tensor) and key not in ("step", "state_counter", "sr_counter"):
                    total += t.numel() * t.element_size()
        return total

    def warn_fallback(self, why: str) -> None:
        """A warning, shown once per call site by Python's default filter (no state of ours)."""
        warnings.warn(f"engine.optim: fused=True runs the Python reference step: {why}", stacklevel=3)


#: a state dict entry: the states `state_dict` wrote decoded to fp32 (a list of names)
DECODED = "decoded_fp32"


def check_loaded(state: dict, name: str, source: StateFormat, old: dict, index: int) -> None:
    """ValueError unless state[name] (and its scales) are stored as the saved format `source` says. A DCP load
    into a template of other formats fills the template's tensors with the checkpoint's values cast to the
    template's dtypes (and the param groups with the checkpoint's formats): that is caught here."""
    expected = formats.storage_dtype(source)
    data = sharded.local(state[name])
    scaled = name + "_scale" in state
    if data.dtype == expected and scaled == source.blocked:
        return
    got = f"a {data.dtype} tensor" + (" with block scales" if scaled else " without block scales")
    raise ValueError(
        f"load_state_dict: state {name!r} of parameter {index} is {got}, but its saved format {source.name!r} "
        f"stores {expected}" + (" with block scales" if source.blocked else "") + ". A distributed checkpoint "
        "loaded (dcp.load) into a template of other state formats than the checkpoint's gets the checkpoint's "
        "values cast into the template's tensors. Load it into an optimizer with the checkpoint's formats "
        f"(state_dtype={dict(old) or 'fp32'}) and hand that optimizer's state_dict() to this one's "
        "load_state_dict, which converts across formats.")


def formats_advance(counter: torch.Tensor, count: int) -> None:
    counter[1:].add_(count)
