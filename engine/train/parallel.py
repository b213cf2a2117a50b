"""The demo on several processes: FSDP2 over data-parallel ranks, tensor parallel inside each group.

`engine train --nproc N --tp K` (or `torchrun --nproc-per-node N -m engine train --tp K`) arranges
the N ranks as a (N/K) x K mesh named ("dp", "tp"):

* tp: every block's QKV `LayerNormLinear` is split by columns (whole heads per rank: the model's
  QKV layout is heads-major), the attention projection by rows, and the `LayerNormMLP` as Megatron
  splits it (`engine.distributed.LayerNormMLPParallel`). The ranks of a tp group see the same tokens.
* dp: each block and then the whole model is `fully_shard`ed over the dp ranks; each takes its slice
  of the global batch, and FSDP2 averages the gradients. FP8 primary weights (--fp8-weights) that
  FSDP2 cannot cut into whole scale blocks stay whole on every rank, their gradients averaged by a
  hook (`engine.distributed.fsdp.replicated_weights`).

Delayed scaling reduces its amaxes over all ranks (the default `fp8_group`), once per step, so every
rank quantizes with the same scales. The checkpoint holds the full (unsharded) model and optimizer
state, as a single-process run writes it: `engine eval`, `--resume` and one-process runs read it.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from engine.train.model import GPT, GPTConfig


def world() -> tuple[int, int]:
    """(rank, world size): (0, 1) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def check_layout(nproc: int, tp: int, model: GPTConfig) -> None:
    """Refuse, naming the argument, a tensor-parallel degree that does not divide the ranks or the model."""
    if nproc % tp:
        raise ValueError(f"--tp: must divide the number of processes ({nproc}), got {tp}")
    if model.moe_experts and tp > 1:
        raise ValueError(f"--tp {tp}: not with --moe (the tensor-parallel plan splits dense MLPs); MoE runs shard "
                         "with FSDP2 only: leave --tp out")
    if model.n_heads % tp:
        raise ValueError(f"--tp: must divide --heads ({model.n_heads}) so each rank holds whole heads, got {tp}")
    if model.ffn_mult * model.d_model % tp:
        raise ValueError(f"--tp: must divide the MLP width ({model.ffn_mult * model.d_model}), got {tp}")


class DataParallel(NamedTuple):
    """Where this rank stands after `parallelize`."""

    rank: int  # in its data-parallel group
    size: int  # data-parallel ranks
    replicated: dict[str, str]  # FP8 weights every rank keeps whole (FSDP2 cannot shard them), by name: why


def parallelize(model: GPT, tp: int) -> DataParallel:
    """Shard `model` in place over the initialised world.

    FP8 primary weights that FSDP2 cannot cut into whole scale blocks (`engine.distributed.fsdp.shard_refusal`,
    e.g. a 384-row weight of 128x128 tiles on 2 ranks) are left out of FSDP2: every rank keeps them whole and their
    gradients are averaged over the data-parallel ranks after each backward.
    """
    size = world()[1]
    if size == 1:
        return DataParallel(0, 1, {})
    check_layout(size, tp, model.cfg)
    from torch.distributed.device_mesh import init_device_mesh

    import engine.distributed as ed

    dp = size // tp
    mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = {"attn.qkv": ed.ColwiseParallel(), "attn.proj": ed.RowwiseParallel(), "mlp": ed.LayerNormMLPParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    replicated: dict[str, str] = {}
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        from engine.distributed.fsdp import average_gradients, replicated_weights

        whole = replicated_weights(model, dp)
        ignored = {param for param, _ in whole.values()}
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], ignored_params=ignored)
        fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
        average_gradients([param for param, _ in whole.values()], mesh["dp"].get_group())
        replicated = {name: reason for name, (_, reason) in whole.items()}
    return DataParallel(mesh.get_coordinate()[0], dp, replicated)


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` for gradients on different device meshes (TP blocks on the 2-D mesh, the
    embeddings on the dp mesh): the norm of each mesh's gradients, then of those."""
    from torch.distributed.tensor import DTensor, Replicate

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for mesh, grads in by_mesh.items():
        factor = coef if mesh is None else DTensor.from_local(coef, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch._foreach_mul_(grads, factor)
    return total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor gathered whole, on the CPU: what one process would save. FP8
    components are gathered as their bytes (gloo has no float8 collectives)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            local, dtype = value.to_local(), value.dtype
            if local.element_size() == 1:
                local = local.view(torch.uint8)
            whole = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                       shape=value.shape, stride=value.stride())
            value = whole.redistribute(placements=[Replicate()] * value.device_mesh.ndim).to_local().view(dtype)
        out[key] = value.detach().cpu()
    return out


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over all ranks (the logged loss of the global batch)."""
    if world()[1] > 1:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= world()[1]
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank))
    init_from_environment()
    try:
        fn(*args)
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()


def init_from_environment() -> None:
    """Join the process group torchrun (or `spawn_ranks`) described in the environment; share the cores."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(max(1, math.floor((os.cpu_count() or 1) / local)))


def spawn_ranks(nproc: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run `fn(*args)` on `nproc` local processes joined by a gloo (or NCCL) group on 127.0.0.1."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(nproc, free_port(), fn, args), nprocs=nproc, join=True)
