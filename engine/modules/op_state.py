"""A recipe state inside the compiled linear's custom ops, rebuilt from the recipe key and the module's tensors.

A custom op gets no Python objects, only the recipe's key (a string) and tensors; it may not write its
inputs. Two kinds of module state pass through it:

- scaling state (`RecipeState.op_tensors()`: delayed scaling's scale and amax history): the recipe rebuilds
  a state reading it that records into fresh tensors (`Recipe.op_state`), merged back by
  `Recipe.merge_records` outside the op;
- stochastic-rounding counters (`rng_counters` of the state: NVFP4's gradients): the op quantizes with
  copies of the module's quantizers that advance clones of the counters, and returns the clones; the
  module's counters take their values (`merge_counters`) outside the op, as eager code would have left them.

States are made from the recipe once per key, outside FakeTensor and tracing modes and without moving torch's
random generator (`template`: NVFP4 draws each module's random stream from it when a module builds its states,
and an op must neither draw nor trace that); a call copies what it advances.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from engine.recipes import BACKWARD_ROLES, FORWARD_ROLES, RecipeState, Role
from engine.recipes.plain import recipe_for_key


class Plan(NamedTuple):
    """What the ops of one GEMM of a recipe return and save, known from the recipe key alone."""

    x_scheme: str | None  # scheme of the x a forward saves for wgrad (None: high precision)
    w_scheme: str | None  # scheme of the W a forward saves for dgrad
    x_rows: int  # x's wgrad copy has its rows (tokens) padded to a multiple of this (NVFP4's RHT: 16)
    fwd_records: int  # scaling records a forward op returns
    fwd_counters: int  # counters a forward op returns (after the records)
    bwd_counters: int  # counters a backward op returns (after the records)


@lru_cache(maxsize=256)
def template(recipe: str, forward: bool, num_gemms: int) -> RecipeState:
    """The recipe's state (made once; its counters are never advanced: calls advance copies)."""
    with _disable_current_modes(), torch.random.fork_rng(devices=[]):  # no FakeTensor / tracing mode sees it
        return recipe_for_key(recipe).make_state(forward=forward, num_gemms=num_gemms)


@lru_cache(maxsize=256)
def plan(recipe: str, num_gemms: int, gemm: int) -> Plan:
    """What the ops of GEMM `gemm` of a module with `num_gemms` GEMMs return and save under the recipe key."""
    fwd, bwd = template(recipe, True, num_gemms), template(recipe, False, num_gemms)
    x_scheme, w_scheme = fwd.saved_schemes[gemm]
    x_col = fwd.uses(Role.INPUT, gemm)[1]
    return Plan(x_scheme, w_scheme, 1 if x_col is None else x_col.columnwise_row_multiple, fwd.op_records,
                len(counters_of(fwd)), len(counters_of(bwd)))


def counters_of(state: RecipeState) -> list[torch.Tensor]:
    """The stochastic-rounding counters a state's quantizers advance in place (none for most recipes)."""
    return list(getattr(state, "rng_counters", ()))


def op_inputs(state: RecipeState) -> list[torch.Tensor]:
    """What an op reads of a module's state: its scaling state, then its counters."""
    return [*state.op_tensors(), *counters_of(state)]


def op_state(recipe: str, forward: bool, num_gemms: int, tensors: list[torch.Tensor]
             ) -> tuple[RecipeState, list[torch.Tensor], list[torch.Tensor]]:
    """(state, scaling records, advanced counters) for one op call on a module's `op_inputs`."""
    base = template(recipe, forward, num_gemms)
    n = len(counters_of(base))
    scaling, counters = tensors[:len(tensors) - n], tensors[len(tensors) - n:]
    if scaling:
        state, records = recipe_for_key(recipe).op_state(forward=forward, num_gemms=num_gemms, tensors=scaling)
    else:
        state, records = base, []
    if not counters:
        return state, records, []
    state, advanced = _with_counters(state, base, counters)
    return state, records, advanced


def _with_counters(state: RecipeState, base: RecipeState, counters: list[torch.Tensor]
                   ) -> tuple[RecipeState, list[torch.Tensor]]:
    """A state whose quantizers are `state`'s, those that advance one of `base`'s counters copied to advance a
    clone of the module's counter at the same position instead; and the clones."""
    clones = {id(old): given.clone() for old, given in zip(counters_of(base), counters)}
    twins: dict[int, object] = {}

    def twin(q):  # noqa: ANN001, ANN202 - a Quantizer or None
        counter = getattr(getattr(q, "rule", None), "rng_counter", None)
        if counter is None or id(counter) not in clones:
            return q
        if id(q) not in twins:
            twins[id(q)] = q.copy()
            twins[id(q)].rule = copy.copy(q.rule)
            twins[id(q)].rule.rng_counter = clones[id(counter)]
        return twins[id(q)]

    roles = FORWARD_ROLES if state.forward else BACKWARD_ROLES
    quantizers = {(use, gemm): twin(state.operand(use, gemm))
                  for gemm in range(state.num_gemms) for role in roles for use in role.uses}
    return RecipeState(state.recipe, state.forward, state.num_gemms, quantizers), list(clones.values())


def merge_counters(counters: list[torch.Tensor], advanced: list[torch.Tensor]) -> None:
    """The module's counters take the values an op left in its clones (what eager quantizing leaves)."""
    with torch.no_grad():
        for counter, new in zip(counters, advanced):
            counter.copy_(new)
