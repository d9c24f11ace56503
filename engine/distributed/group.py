"""TensorParallelGroup: this process's place in a tensor-parallel run.

A run with `tp_size=N` is N processes started by `torchrun --nproc-per-node N`; each
holds 1/N of every attention head group and MLP column, and its own KV cache for its
heads. Rank 0, the driver, owns the scheduler, the requests and the sampler; every
step it broadcasts the step's plan (the flat inputs of `engine.step.batch`) to the other
ranks, the followers, and all ranks run the forward together, summing partial
outputs with all-reduce.

Two process groups:
- the device group (nccl on CUDA, gloo on CPU) carries the all-reduces of the forward;
- the control group (always gloo, on the host) carries the pickled plans, the cache
  sizing and final results. Its collectives give up after
  `ContinuousBatchingConfig.cpu_group_timeout` seconds, so a dead rank makes the
  others fail instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DRIVER_RANK = 0
NO_TIMEOUT = datetime.timedelta(days=3650)
"""Stands for `cpu_group_timeout=None` (torch wants a finite timeout)."""


class TensorParallelError(ValueError):
    """The tensor-parallel setup is impossible (wrong launch, unshardable model)."""


def as_timeout(seconds: float | None) -> datetime.timedelta:
    return NO_TIMEOUT if seconds is None else datetime.timedelta(seconds=seconds)


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    device_group: Any
    control_group: Any
    _control_groups: dict = field(default_factory=dict)

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; every rank calls it in the same order."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def broadcast(self, payload: Any = None) -> Any:
        """The driver's `payload`, on every rank (followers pass nothing)."""
        box = [payload if self.is_driver else None]
        dist.broadcast_object_list(box, src=DRIVER_RANK, group=self.control_group)
        return box[0]

    def set_control_timeout(self, seconds: float | None) -> None:
        """Use a control group whose collectives time out after `seconds` (the
        manager's `cpu_group_timeout`); every rank must call it at the same point.
        Groups are created once per timeout value and reused by later managers."""
        if seconds not in self._control_groups:
            self._control_groups[seconds] = dist.new_group(backend="gloo",
                                                           timeout=as_timeout(seconds))
        self.control_group = self._control_groups[seconds]


def init_tensor_parallel(tp_size: int, device: torch.device,
                         timeout_s: float | None = 300.0) -> TensorParallelGroup:
    """Join (or reuse) the torchrun process group of `tp_size` processes.

    Raises TensorParallelError when the process was not launched with exactly
    `tp_size` workers. The driver is global rank 0 (RANK), wherever the rendezvous put
    it; on CUDA each rank takes the GPU of its LOCAL_RANK, its index on its own node,
    so node ranks of a multi-node launch each count their GPUs from 0.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != tp_size:
        raise TensorParallelError(
            f"tp_size={tp_size} needs {tp_size} processes, but WORLD_SIZE is {world_size}: "
            f"launch with `torchrun --nproc-per-node {tp_size} ...` (one host) or "
            f"`torchrun --nnodes M --nproc-per-node {tp_size}/M ...` (M hosts)")
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise TensorParallelError(
                f"LOCAL_RANK {local_rank} has no GPU: this node has "
                f"{torch.cuda.device_count()}; lower --nproc-per-node on this node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=as_timeout(timeout_s))
    control_group = dist.new_group(backend="gloo", timeout=as_timeout(timeout_s))
    return TensorParallelGroup(rank=dist.get_rank(), world_size=dist.get_world_size(),
                               device=device, device_group=dist.group.WORLD,
                               control_group=control_group,
                               _control_groups={timeout_s: control_group})
