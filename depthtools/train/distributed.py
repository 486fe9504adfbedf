"""Data parallelism for one cell under `torchrun`: DDP (replicas) or FSDP2 (sharded), CPU or GPU.

    torchrun --nproc_per_node=8 -m depthtools.train run.json
    torchrun --nproc_per_node=8 -m cli train --arch hc --layers 24 --budget 405.4M --data data/x --parallel fsdp

`setup` joins the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT): NCCL on CUDA, gloo on CPU. A plain `python` run has no WORLD_SIZE and gets the
single-process `Dist()`, so the trainer's single-process path is untouched.

What stays the same whatever the world size: each step trains on the same GLOBAL batch (rank r takes
its contiguous share of the rows, see `TrainBatches`); DDP averages gradients over ranks, which for
equal shares is the gradient of the global mean loss; checkpoints hold full (unsharded) tensors. So a
run may resume with another world size, or switch between DDP and FSDP. Only rank 0 writes files.

FSDP2 units: every block's `mlp` (called as a module by every scheme) and the root, a `LossModule`
around the whole model so that every forward, also the depth probe's state-by-state one, goes through
a module call that FSDP hooks. Attention stays in the root unit because MoDA reads its projections
directly. Checkpoints gather the full state dict (a collective: every rank calls `full_state`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from depthtools.errors import DepthToolsError


@dataclass(frozen=True)
class Dist:
    """Where this process sits: rank of world_size, its local rank, and the sharding kind."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = "ddp"
    owns_group: bool = False  # True when `setup` created the process group (then `teardown` ends it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.parallel == "fsdp"


def env_rank() -> int:
    """This process's global rank from torchrun's environment (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def setup(device_type: str, parallel: str = "ddp") -> Dist:
    """Join torchrun's process group if WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); else `Dist()`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(parallel=parallel)
    owns = not dist.is_initialized()
    if owns:
        if device_type == "cuda":
            torch.cuda.set_device(local_device_index())
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")), parallel=parallel, owns_group=owns)


def teardown(d: Dist, ok: bool) -> None:
    """Barrier (after a clean finish, so no rank exits while rank 0 still writes), then end the group."""
    if not d.enabled:
        return
    if ok:
        dist.barrier()
    if d.owns_group:
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def local_device_index() -> int:
    """The CUDA device of this rank: LOCAL_RANK modulo the visible devices (1 visible each also works)."""
    return int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())


def local_device(device: torch.device, d: Dist) -> torch.device:
    """cuda -> cuda:<local device> under torchrun; CPU stays CPU."""
    if d.enabled and device.type == "cuda":
        return torch.device("cuda", local_device_index())
    return device


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A torch seed per (run seed, rank, start step): ranks draw different noise, reproducibly.

    The model is built from `seed` on every rank (identical weights; DDP also broadcasts rank 0's);
    this only reseeds the global torch RNG afterwards, for anything stochastic inside the step.
    """
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


def check_same(d: Dist, value: int, what: str, device: torch.device) -> None:
    """Refuse to train when ranks disagree on `value` (e.g. resumed from different train_state files)."""
    if not d.enabled:
        return
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        raise DepthToolsError(
            f"ranks disagree on {what} ({-int(both[1])}..{int(both[0])}); the cell folder must be on a "
            "filesystem every rank sees"
        )


def rows_per_rank(batch_size: int, micro_batch_size: int | None, d: Dist) -> tuple[int, int]:
    """(rows of this rank's share of the batch, rows per micro-batch), with a one-line error if they do not divide."""
    if batch_size % d.world_size:
        raise DepthToolsError(f"batch_size={batch_size} must be divisible by the world size {d.world_size}")
    rows = batch_size // d.world_size
    micro = min(micro_batch_size or batch_size, rows)
    if rows % micro:
        raise DepthToolsError(
            f"each of the {d.world_size} ranks gets {rows} rows per step, not a multiple of "
            f"micro_batch_size={micro_batch_size}; pick a micro_batch_size dividing {rows}"
        )
    return rows, micro


def wrap(module: nn.Module, d: Dist, device: torch.device) -> nn.Module:
    """The step module under DDP or FSDP2 (FSDP2 shards in place: build the optimizer afterwards)."""
    if d.fsdp:
        # FSDP2 cannot shard 0-d parameters (HC/mHC gates, ReZero gains): they stay replicated and
        # `reduce_replicated_grads` averages their gradients.
        scalars = [p for _, p in module.named_parameters() if p.dim() == 0]  # same order on every rank
        for block in module.model.blocks:
            fully_shard(block.mlp, ignored_params=set(scalars))
        wrapped = fully_shard(module, ignored_params=set(scalars))
        wrapped.replicated_params = scalars
        return wrapped

    ids = [device.index] if device.type == "cuda" else None
    # No buffer sync in forward: the only buffers are constant RoPE tables, and eval stays collective-free.
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters  # broadcast_buffers is deprecated
    quiet = "forward_sync_buffers" if new_name else "broadcast_buffers"
    return DDP(module, device_ids=ids, **{quiet: False})


def grad_sync(wrapped: nn.Module | None, sync: bool):
    """Context for one micro-step: reduce gradients only when `sync` (the last micro-step of a step)."""
    if wrapped is None or sync:
        if wrapped is not None and hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    wrapped.set_requires_gradient_sync(False)  # FSDP2: a flag, reset on the last micro-step
    return contextlib.nullcontext()


def reduce_replicated_grads(wrapped: nn.Module | None, d: Dist) -> None:
    """FSDP2: average the gradients of the parameters it left replicated (one all-reduce per step)."""
    params = getattr(wrapped, "replicated_params", [])
    if not d.enabled or not params:
        return
    flat = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad.reshape(()) for p in params])
    dist.all_reduce(flat)
    for p, g in zip(params, flat / d.world_size):
        p.grad = g.clone()


def reduce_log(d: Dist, loss_sum: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Across ranks: mean of the summed per-rank losses, and whether any rank saw NaN/inf (one all-reduce)."""
    if not d.enabled:
        return loss_sum, bad
    both = torch.stack([loss_sum.float(), bad.float()])
    dist.all_reduce(both)
    return both[0] / d.world_size, both[1] > 0


def clip_grads(params: list[torch.Tensor], max_norm: float, d: Dist) -> torch.Tensor:
    """Total gradient norm, clipped to max_norm when > 0 (torch's functions; under FSDP2 the norm of
    the sharded gradients is gathered and combined with that of the replicated ones by hand)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not d.fsdp:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm(grads)
    sharded = [p for p in params if p.grad is not None and hasattr(p.grad, "full_tensor")]
    plain = [p for p in params if p.grad is not None and not hasattr(p.grad, "full_tensor")]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor()]
    if plain:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain]))
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in (sharded, plain):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# -- full (unsharded) state under FSDP2 ----------------------------------------------------------
class StateView:
    """Stands in for a model or optimizer where the checkpoint code reads `.config` and `state_dict()`."""

    def __init__(self, state: dict[str, Any], config: Any = None):
        self.state, self.config = state, config

    def state_dict(self) -> dict[str, Any]:
        return self.state


def _options(**kw):
    return StateDictOptions(full_state_dict=True, **kw)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's full state dict on CPU (collective; tensors on rank 0, empty elsewhere)."""
    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[StateView, StateView]:
    """Gathered model and optimizer state (collective; full tensors on rank 0, empty elsewhere).

    The optimizer view uses torch's index-keyed layout (positions in `names`), as `optimizer_tensors` reads.
    """
    weights = full_weights(model)
    optim = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    index = {name: i for i, name in enumerate(names)}
    state = {index[k]: v for k, v in optim.get("state", {}).items()}
    groups = [{**g, "params": [index[p] for p in g["params"]]} for g in optim.get("param_groups", [])]
    return StateView(weights, model.config), StateView({"state": state, "param_groups": groups})


def move_optimizer_state(source: torch.optim.Optimizer, names: list[str], model: nn.Module,
                         target: torch.optim.Optimizer) -> None:
    """Copy a full (unsharded) optimizer's state into the optimizer of the sharded `model`."""
    full = source.state_dict()
    if not full["state"]:
        return
    state = {names[i]: v for i, v in full["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]]
    set_optimizer_state_dict(model, target, {"state": state, "param_groups": groups}, options=_options())
