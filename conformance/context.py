"""The object every check body receives on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from conformance.adapters.base import Implementation, NotSupported

_MESHES: dict[tuple, object] = {}  # one DeviceMesh per (device type, shape, names) per process


def cached_meshes() -> list:
    """The meshes this process keeps for reuse across checks (:meth:`CheckContext.make_mesh`):
    their process groups outlive a check (see [Note: per-check cleanup] in
    :mod:`conformance.runner.resources`)."""
    return list(_MESHES.values())


@dataclass
class CheckContext:
    """Where a check runs: this rank, the group, the device and the implementation under test."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    impl: Implementation | None
    params: dict = field(default_factory=dict)
    deadline: float | None = None  # time.monotonic() when the driver gives up on this check

    def time_left(self) -> float:
        """Seconds until the check's deadline (``inf`` without one): a check that starts its own
        subprocess bounds it with this, keeping a margin for reporting."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    @cached_property
    def mesh(self):
        """A 1-D ``DeviceMesh`` over all ranks (created once per process and reused)."""
        return self.make_mesh((self.world_size,))

    def make_mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        key = (self.device.type, tuple(shape), names)
        if key not in _MESHES:
            _MESHES[key] = init_device_mesh(self.device.type, tuple(shape), mesh_dim_names=names)
        return _MESHES[key]

    def require(self, *capabilities: str) -> None:
        """Raise :class:`NotSupported` unless the implementation declares every capability."""
        missing = [c for c in capabilities if self.impl is None or c not in self.impl.capabilities]
        if missing:
            raise NotSupported.undeclared(*missing)

    def seed(self, value: int = 0) -> None:
        """Seed every rank identically so models built here start equal on all ranks."""
        torch.manual_seed(value)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def where(self) -> str:
        """A prefix for assertion messages: which rank saw it."""
        return f"[rank {self.rank}/{self.world_size}]"
