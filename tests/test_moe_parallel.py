"""Expert parallel (engine.moe.expert_parallel) composed with FSDP2 over the other parameters, on 2 and 4 gloo
processes (one spawn per world size runs every case), against one process running the global batch.

The model is Linear -> LayerNorm -> MoEMLP (8 experts, top 2; engine.Linear experts, E / world per rank) -> Linear,
with residuals; the torch Linears, the norm and the router are sharded by FSDP2, the experts are this rank's own.
Three SGD steps under bf16-free fp32 activations, without autocast and under every recipe engine.recipes exports.
The reference runs the ranks' batches concatenated (so each expert sees the same rows in the same order, and
per-tensor scales see the same amaxes) and the global mean loss; only the order of gradient sums can differ, so
losses and weights agree within an fp32 bound. Under delayed scaling every rank's autocast reduces amaxes over a
group of its own (the experts of two ranks are different modules). The aux loss is left out (coefficient 0) but in
the "balance" case (high precision, capacity factor 1 and the aux loss in the loss): there both are the group's, so
the reference computes them once over the concatenated batch (an expert keeps its earliest rows of it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoint_specs as specs
import engine
from engine.moe import ExpertLinears, MoEMLP, expert_parallel

D, FFN, EXPERTS, TOKENS, STEPS, LR = 32, 32, 8, 12, 2, 0.1
BALANCE = "balance"  # high precision with a capacity and the aux loss, both over the group
CASES = [None, BALANCE] + [c.__name__ for c in specs.exported_recipe_classes()]
#: 4 ranks (4 processes on 2 cores: kept short): high precision and a 1 x block recipe
CASES_4 = [None, BALANCE, "MXFP8BlockScaling"]
CAPACITY, AUX = 1.0, 0.5  # the balance case's: 24 (48 on 4 ranks) tokens x 2 picks / 8 experts -> 6 (12) rows
RANKS = {2: CASES, 4: CASES_4}


def pin_streams(moe: MoEMLP, first: int) -> None:
    """Set each expert's stochastic-rounding counters (gradients) from its global index: they are drawn from torch's
    generator when a module builds its states, in call order, which differs between a rank and one process."""
    for g, fc in enumerate((moe.fc1, moe.fc2)):
        for i, linear in enumerate(fc.linears):
            state = linear._bwd_state
            plain = state.to_plain() or {}
            if plain.get("rng_counter") is not None:
                counter = plain["rng_counter"].clone()
                counter[:, 0] = 1000 * (first + i + 1) + 100 * g + torch.arange(counter.shape[0])
                state.load_plain({**plain, "rng_counter": counter})


class TinyMoE(torch.nn.Module):
    def __init__(self, balance: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.norm = torch.nn.LayerNorm(D)
        self.moe = MoEMLP(D, FFN, EXPERTS, top_k=2, aux_loss_coef=AUX if balance else 0.0,  # names per expert
                          capacity_factor=CAPACITY if balance else None, experts=ExpertLinears)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(self.norm(h)))


def make_model(case: str | None = None) -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE(balance=case == BALANCE)


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(world * TOKENS, D, generator=torch.Generator().manual_seed(100 + step))


def recipe_of(case: str | None):
    return None if case in (None, BALANCE) else specs.make_recipe(case)


def expert_weights(model: TinyMoE) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.moe.named_parameters() if n.startswith("fc")}


# ------------------------------------------------------------------------------------------ the ranks
def _train(case: str | None, rank: int, world: int, own_group) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = make_model(case)
    experts = expert_parallel(model)
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model, ignored_params=experts)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        recipe = recipe_of(case)
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe, fp8_group=own_group):
            loss = model(batch(step, world).chunk(world)[rank]).float().square().mean() + model.moe.aux_loss
        if step == 0 and recipe is not None:
            pin_streams(model.moe, model.moe.local_experts[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    shared = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if hasattr(p, "full_tensor")}
    return {"losses": torch.stack(losses), "shared": shared, "experts": expert_weights(model)}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        groups = [dist.new_group([r]) for r in range(world)]
        result = {str(case): _train(case, rank, world, groups[rank]) for case in RANKS[world]}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"moe_ep{world}")
    mp.spawn(_worker, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=True)
    return world, [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world)]


# ------------------------------------------------------------------------------------------ one process
def moe_as_the_ranks_run_it(moe: MoEMLP, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The MoE layer over every rank's tokens, written out: each chunk routed on its own; each expert's engine.Linear
    pair run once on the rows of every chunk that picked it (by chunk, then token, then pick), its first
    `capacity` of them over all chunks when the layer has a capacity factor; each token's kept picks weighted and
    added in pick order in fp32. Also the aux loss E * sum_e f_e * P_e over all chunks' tokens (times its coef)."""
    routes, all_probs = [], []
    for x in chunks:
        probs = torch.softmax(moe.router(x.float()), dim=-1)
        top, picks = probs.topk(moe.top_k, dim=-1)
        routes.append((top / top.sum(-1, keepdim=True), picks))
        all_probs.append(probs)
    probs, picks = torch.cat(all_probs), torch.cat([p for _, p in routes])
    share = torch.stack([(picks == e).sum() for e in range(moe.num_experts)]).float() / picks.numel()
    aux = moe.aux_loss_coef * moe.num_experts * (share * probs.mean(dim=0)).sum()
    limit = None if moe.capacity_factor is None else \
        math.ceil(moe.capacity_factor * probs.shape[0] * moe.top_k / moe.num_experts)
    outputs = {}
    for e in range(moe.num_experts):
        keys = [(c, t, k) for c, (_, picks) in enumerate(routes) for t in range(picks.shape[0])
                for k in range(moe.top_k) if int(picks[t, k]) == e][:limit]
        if not keys:
            continue
        rows = torch.stack([chunks[c][t] for c, t, _ in keys])
        out = moe.fc2.linears[e](torch.nn.functional.gelu(moe.fc1.linears[e](rows), approximate="tanh"))
        outputs.update({key: out[i] for i, key in enumerate(keys)})
    merged = []
    for c, (top, _) in enumerate(routes):
        tokens = []
        for t in range(top.shape[0]):
            acc = torch.zeros(D)
            for k in range(moe.top_k):
                if (c, t, k) in outputs:  # else dropped by the capacity
                    acc = acc + outputs[c, t, k].float() * top[t, k]
            tokens.append(acc)
        merged.append(torch.stack(tokens))
    return merged, aux


def reference(case: str | None, world: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: every rank's micro-batch through the torch layers on its own (their GEMMs and gradient sums as
    FSDP2's ranks make them), the MoE layer as the ranks run it together; the mean of the ranks' losses."""
    model = make_model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        recipe = recipe_of(case)
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            hs = [model.inp(x) for x in batch(step, world).chunk(world)]
            ys, aux = moe_as_the_ranks_run_it(model.moe, [model.norm(h) for h in hs])
            parts = [model.out(h + y).float().square().mean() for h, y in zip(hs, ys)]
        loss = torch.stack(parts).sum() / world + aux
        if step == 0 and recipe is not None:
            pin_streams(model.moe, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    shared = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("moe.fc")}
    return torch.stack(losses), shared, expert_weights(model)


def local_name(name: str, rank: int, world: int) -> str:
    """A global expert's parameter name as its rank holds it (fc1.linears.5.weight -> rank 1's fc1.linears.1.weight
    with 8 experts on 4 ranks)."""
    fc, linears, index, rest = name.split(".", 3)
    return f"{fc}.{linears}.{int(index) - rank * (EXPERTS // world)}.{rest}"


@pytest.mark.parametrize("case", [str(c) for c in CASES])
def test_expert_parallel_with_fsdp2_equals_one_process(ranks, case: str) -> None:
    world, results = ranks
    if case not in map(str, RANKS[world]):
        pytest.skip(f"{world} ranks run {[str(c) for c in RANKS[world]]} (every recipe runs on 2)")
    losses, shared, experts = reference(None if case == "None" else case, world)
    got = torch.stack([r[case]["losses"] for r in results]).mean(0)
    torch.testing.assert_close(got, losses, rtol=1e-5, atol=1e-7)
    for r in results:
        assert sorted(r[case]["shared"]) == sorted(shared)
        for name, want in shared.items():
            torch.testing.assert_close(r[case]["shared"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    per_rank = EXPERTS // world
    for name, want in experts.items():
        rank = int(name.split(".")[2]) // per_rank
        held = results[rank][case]["experts"]
        assert len(held) == len(experts) // world
        torch.testing.assert_close(held[local_name(name, rank, world)], want, rtol=1e-5, atol=1e-6, msg=name)
