"""Shared vocabulary of the FSDP2 reference: meshes, training states, small tensor helpers.

[Note: meshes]
``fully_shard`` takes a :class:`DeviceMesh`. A 1-D mesh means plain FSDP: every rank holds one
shard of each parameter (placement ``(Shard(0),)``). A 2-D mesh ``(replicate, shard)`` means HSDP:
parameters are sharded over the last dim and replicated over the first (placement
``(Replicate(), Shard(0))``); gradients are reduce-scattered over the shard group and then
all-reduced over the replicate group.

[Note: tensor parallel]
With tensor parallelism (P15) a parameter arrives as a ``DTensor`` on a 1-D TP mesh (e.g. from
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``) and ``fully_shard`` gets the
data-parallel mesh. FSDP shards the TP-*local* tensor along dim 0 over dp exactly as it shards a
plain tensor; the sharded parameter is a ``DTensor`` on the (dp, tp) mesh with placements (FSDP
placement, TP placement), the FSDP one a ``_StridedShard(0, split_factor=k)`` when TP already cut
dim 0 into ``k`` pieces (dp then splits each TP piece, not the whole dim), and ``full_tensor()`` is
the original. The unsharded parameter is re-wrapped as a ``DTensor`` on the TP mesh for compute,
its gradient redistributed to the TP placements and its local tensor reduce-scattered over dp.
Resharding after forward onto a smaller mesh is refused for such parameters, as upstream does.
"""

from __future__ import annotations

import itertools
import sys
import traceback
import warnings
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# top-level packages whose frames are never "the caller" of a public API
_INTERNAL = frozenset({"reference", "torch", "contextlib"})


def _warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn about how a public API was called, attributed to the caller's call of that API.

    [Note: caller attribution]
    Rule (X5): a warning about a call records the file and line of the user's call of the public
    API (for a unit's forward, ``model(x)``), not a line of the implementation. The depth of that
    call varies (``nn.Module.__call__`` runs the hooks; a root's post-forward finishes the states
    that did not run), so no fixed ``stacklevel`` fits: the warning points at the first frame,
    going up, whose module is outside this package, torch and contextlib (the frame that warns
    when every one is inside).
    """
    frames = traceback.walk_stack(sys._getframe(1))  # the function that warns is level 1
    outside = (n for n, (f, _) in enumerate(frames, 1) if not _internal(f.f_globals))
    warnings.warn(message, category, stacklevel=next(outside, 1) + 1)  # +1: this helper


def _internal(module_globals: dict) -> bool:
    return module_globals.get("__name__", "").partition(".")[0] in _INTERNAL


class FSDPMeshInfo:
    """A mesh, the dim parameters are sharded over, and this rank's group and rank on it."""

    def __init__(self, mesh: DeviceMesh, shard_mesh_dim: int) -> None:
        self.mesh, self.shard_mesh_dim = mesh, shard_mesh_dim
        self.shard_mesh_size = mesh.size(shard_mesh_dim)
        self.shard_process_group = mesh.get_group(shard_mesh_dim)
        self.shard_mesh_rank = self.shard_process_group.rank()


class HSDPMeshInfo(FSDPMeshInfo):
    """An :class:`FSDPMeshInfo` that also replicates over ``replicate_mesh_dim`` (HSDP)."""

    def __init__(self, mesh: DeviceMesh, shard_mesh_dim: int, replicate_mesh_dim: int) -> None:
        super().__init__(mesh, shard_mesh_dim)
        self.replicate_mesh_dim = replicate_mesh_dim
        self.replicate_process_group = mesh.get_group(replicate_mesh_dim)


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


_orig_param_uids = itertools.count()


def _get_orig_param_uid(param: nn.Parameter) -> int:
    """A stable id stored on an original parameter (to find one sharded by two groups)."""
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
