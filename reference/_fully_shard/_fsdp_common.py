"""Shared vocabulary of the FSDP2 reference: mesh descriptions, training states, small helpers.

[Note: meshes]
``fully_shard`` takes a :class:`DeviceMesh`. A 1-D mesh means plain FSDP: every rank holds one
shard of each parameter (placement ``(Shard(0),)``). A 2-D mesh ``(replicate, shard)`` means HSDP:
parameters are sharded over the last dim and replicated over the first (placement
``(Replicate(), Shard(0))``); gradients are reduce-scattered over the shard group and then
all-reduced over the replicate group. ``FSDPMeshInfo`` / ``HSDPMeshInfo`` cache the groups and this
rank's coordinates so that the rest of the code never re-derives them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class FSDPMeshInfo:
    """A mesh plus the dim parameters are sharded over (``shard_mesh_dim``)."""

    mesh: DeviceMesh
    shard_mesh_dim: int

    def __post_init__(self) -> None:
        self.shard_mesh_size = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank = self.shard_process_group.rank()


@dataclass
class HSDPMeshInfo(FSDPMeshInfo):
    """An :class:`FSDPMeshInfo` that also replicates over ``replicate_mesh_dim`` (HSDP)."""

    replicate_mesh_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self.replicate_mesh_size = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group = self.mesh.get_group(self.replicate_mesh_dim)


class TrainingState(Enum):
    """Where one FSDP state / parameter group is within an iteration."""

    FORWARD = auto()  # between its pre-forward and post-forward hooks
    PRE_BACKWARD = auto()  # its parameters were unsharded for backward
    POST_BACKWARD = auto()  # its gradients were reduced
    IDLE = auto()  # none of the above


def _to_dtype_if_needed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor


def _cast_fp_tensor(dtype: torch.dtype, x: object) -> object:
    """Cast ``x`` to ``dtype`` if it is a floating-point tensor of another dtype."""
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


def is_bw() -> bool:
    """Whether autograd's engine is currently running a backward pass."""
    return torch._C._current_graph_task_id() != -1


_orig_param_uids = itertools.count()


def _get_orig_param_uid(param: nn.Parameter) -> int:
    """A stable id for an original parameter, stored on it (used to reject double wrapping)."""
    if not hasattr(param, "_fsdp_orig_uid"):
        param._fsdp_orig_uid = next(_orig_param_uids)
    return param._fsdp_orig_uid


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor``'s storage back its full size (after :func:`free_storage`)."""
    size = tensor.numel() * tensor.itemsize
    if (storage := tensor.untyped_storage()).size() != size:
        storage.resize_(size)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory while keeping the tensor (and its views) alive."""
    if (storage := tensor.untyped_storage()).size() != 0:
        storage.resize_(0)
