"""Construction helpers of the FSDP1 wrapper: strategy clamp, managed tensors, compute device.

Vocabulary (managed parameters, owned buffers, root): see ``[Note: the FSDP1 module tree]`` in
:mod:`reference._fsdp1.fully_sharded_data_parallel`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from reference._fsdp1._common_utils import _FSDPState, _warn, clean_tensor_name
from reference._fsdp1._flat_param import FlatParameter
from reference.api import ShardingStrategy


def _clamp_strategy(strategy: ShardingStrategy | None, world_size: int) -> ShardingStrategy:
    if strategy in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2,
    ):
        raise NotImplementedError(f"The reference FSDP does not implement {strategy}")
    if world_size == 1:
        if strategy != ShardingStrategy.NO_SHARD:
            _warn(
                "FSDP is switching to use `NO_SHARD` instead of "
                f"{strategy or ShardingStrategy.FULL_SHARD} since the world size is 1."
            )
        return ShardingStrategy.NO_SHARD
    if strategy == ShardingStrategy.NO_SHARD:
        _warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, "
            "please use `DistributedDataParallel` instead.",
            FutureWarning,
        )
    return strategy or ShardingStrategy.FULL_SHARD


def _managed_tensors(
    module: nn.Module, ignored: set[nn.Module], ignored_params: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[tuple[str, nn.Module, str]]]:
    """Managed parameters (unique, first-visit order) and owned buffers of ``module``: everything
    outside nested FSDP modules and ignored modules, minus ignored parameters."""
    params: list[nn.Parameter] = []
    seen: set[int] = {id(p) for p in ignored_params}
    buffers: list[tuple[str, nn.Module, str]] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if mod in ignored or isinstance(mod, _FSDPState):
            return
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen and not isinstance(p, FlatParameter):
                seen.add(id(p))
                params.append(p)
        for name, b in mod._buffers.items():
            if b is not None:
                buffers.append((clean_tensor_name(prefix + name), mod, name))
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return params, buffers


def _compute_device(device_id: Any, params: list[nn.Parameter], module: nn.Module) -> torch.device:
    """Given ``device_id``, the compute device is that device. Managed parameters on the CPU are
    moved there; the first one anywhere else (left on meta by a ``param_init_fn``, on another
    accelerator) is inconsistent with it, and so is the CPU named with an index (``cpu:0``): the
    CPU compute device is ``cpu`` (R83). Without ``device_id``: the first managed tensor's."""
    if device_id is not None:
        device = torch.device(device_id)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        held = params[0].device if params else torch.device("cpu")
        if held.type == "cpu":
            held = torch.device("cpu") if device.type == "cpu" else device
        if held != device:
            raise ValueError(
                f"Inconsistent compute device and `device_id`: {held} vs {device} (the managed "
                "parameters must be on the CPU or on device_id)"
            )
        return device
    tensors = params + list(module.buffers())
    return tensors[0].device if tensors else torch.device("cpu")


def _materialize_with_init_fn(
    module: nn.Module, param_init_fn: Any, ignored_modules: set[nn.Module]
) -> None:
    """Deferred initialisation: where a parameter or buffer this unit would manage is still on
    the meta device, call ``param_init_fn(m)`` once for every module ``m`` of the unit's own part
    of the tree, breadth first from ``module``: a nested FSDP unit (which materialised itself when
    it was wrapped) and an ignored module, with everything below them, are left out."""
    if not callable(param_init_fn):
        raise ValueError(f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}")
    own = [module]
    for m in own:  # grows while it is walked: a breadth-first walk
        own.extend(
            c for c in m.children() if not isinstance(c, _FSDPState) and c not in ignored_modules
        )
    tensors = [t for m in own for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    if any(t.is_meta for t in tensors):
        for m in own:
            param_init_fn(m)


def _materialize_with_reset_parameters(
    module: nn.Module, device: torch.device, ignored_modules: set[nn.Module]
) -> None:
    """Without ``param_init_fn``: where a tensor this unit would manage is on the meta device,
    every module of the unit's own part of the tree (as above) that holds parameters or buffers
    of its own gets storage on ``device`` and its ``reset_parameters()`` called, in that order."""

    def fn(m: nn.Module) -> None:
        if (
            next(itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)), None)
            is None
        ):
            return
        with torch.no_grad():
            m.to_empty(device=device, recurse=False)
            m.reset_parameters()

    _materialize_with_init_fn(module, fn, ignored_modules)
