"""Tensor parallelism over torch.distributed (docs/deployment.md, "Tensor parallelism"): process
groups, weight sharding and the driver-to-follower step messages."""

from .group import TensorParallelError, TensorParallelGroup, init_tensor_parallel
from .sharding import check_shardable
from .step_sync import StepPlan, StepSync, to_device

__all__ = ["TensorParallelError", "TensorParallelGroup", "init_tensor_parallel",
           "check_shardable", "StepPlan", "StepSync", "to_device"]
