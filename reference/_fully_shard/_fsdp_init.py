"""What ``fully_shard`` checks and collects before it shards anything.

Rules:

* ``module`` may not be a bare ``nn.ModuleList`` / ``nn.ModuleDict`` (no forward to hook).
* The mesh is 1-D (FSDP) or 2-D (HSDP, which needs ``mesh_dim_names``).
* ``reshard_after_forward`` is a bool or an int factor of the shard-mesh size (spec P3): ``1``
  means ``False`` (with a warning), the shard size means ``True``, any other factor reshards
  after forward onto groups of that size.
* *Managed modules* are the module's subtree minus subtrees already under ``fully_shard``;
  *managed parameters* are their parameters minus ``ignored_params``, each once. A scalar (0-D)
  parameter is rejected because it has no dim to shard.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

logger = logging.getLogger("reference.fully_shard")


def _validate_module(module: nn.Module | list[nn.Module], func_name: str) -> None:
    for m in module if isinstance(module, list) else [module]:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"{func_name} does not support containers that do not implement forward: {m}"
            )


def _get_mesh_info(mesh: DeviceMesh) -> FSDPMeshInfo:
    """Validate the mesh: 1-D is FSDP, 2-D (with dim names) is HSDP (replicate, shard)."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    if mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _get_post_forward_mesh_info(
    reshard_after_forward: bool | int, mesh_info: FSDPMeshInfo
) -> FSDPMeshInfo | None:
    """The mesh to reshard to after forward: ``None`` (stay unsharded), the mesh, or a smaller one."""
    raf, shard_size = reshard_after_forward, mesh_info.shard_mesh_size
    if not isinstance(raf, (bool, int)):
        raise ValueError(  # noqa: TRY004 (upstream raises ValueError)
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {raf}"
        )
    if not isinstance(raf, bool):  # an int: 1 means False, the shard size means True
        if raf < 1 or raf > shard_size or shard_size % raf != 0:
            raise ValueError(
                "If passing reshard_after_forward as an int, it should be a factor of "
                f"{shard_size}, not {raf}"
            )
        if raf == 1:
            logger.warning(
                "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
                "instead of reshard_after_forward=True (bool)"
            )
            raf = False
        elif raf == shard_size:
            raf = True
    if isinstance(raf, bool):
        return mesh_info if raf else None
    # A smaller group: rows of `raf` consecutive ranks shard, the columns replicate.
    mesh = DeviceMesh(mesh_info.mesh.device_type, mesh_info.mesh.mesh.view(-1, raf))
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _init_default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default group on the build's accelerator (CPU on a CPU build)."""
    if not dist.is_initialized():
        dist.init_process_group()
    device = torch._C._get_accelerator()
    return init_device_mesh(device.type, mesh_shape=(dist.get_world_size(),))


def _get_device_from_mesh(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _get_managed_modules(root_modules: tuple[nn.Module, ...], get_state) -> list[nn.Module]:
    """Post-order walk of the subtrees, stopping at modules that already have FSDP state."""
    modules: dict[nn.Module, None] = {}  # an ordered set: a shared module counts once

    def dfs(module: nn.Module) -> None:
        if module in modules or (module not in root_modules and get_state(module) is not None):
            return  # seen, or a nested fully_shard module that manages its own subtree
        for child in module.children():
            dfs(child)
        modules[module] = None

    for root in root_modules:
        dfs(root)
    return list(modules)


def _get_managed_states(
    modules: list[nn.Module], ignored_params: set[nn.Parameter] | None
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The modules' parameters (minus ignored ones) and buffers, each once, in order."""
    ignored = ignored_params or set()
    params, buffers = {}, {}  # dicts as ordered sets
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in ignored:
                continue
            if param.ndim == 0:
                raise ValueError(
                    "fully_shard doesn't support scalar parameters. "
                    f"Change {name} to a 1D tensor with numel equal to 1."
                )
            params[param] = None
        buffers.update(dict.fromkeys(module.buffers(recurse=False)))
    return list(params), list(buffers)


def _move_states_to_device(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Move managed parameters and buffers to the mesh's device (meta tensors stay on meta).
    A ``DTensor`` already lives on its own mesh's device, which must be of the FSDP mesh's type."""
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            if (mesh_type := tensor.device_mesh.device_type) != device.type:
                raise ValueError(
                    "Requires DTensor to have mesh of the same type as the FSDP mesh "
                    f"but got {mesh_type} for DTensor and {device.type} for FSDP"
                )
        elif tensor.device != device and tensor.device.type != "meta":
            tensor.data = tensor.to(device)


def _resolve_shard_placement(param: nn.Parameter, placement_fn, mesh_info: FSDPMeshInfo) -> Shard:
    """Validate ``param`` and return its FSDP placement (spec P12, P13).

    ``shard_placement_fn(param)`` may return ``None`` (dim 0) or ``Shard(d)`` (negative ``d``
    counts from the end). The parameter must be contiguous; ``d`` must exist; a dim other than 0
    must divide evenly by the shard-mesh size. For a tensor-parallel ``DTensor`` all of this
    applies to its local (TP-sharded) tensor, which is what FSDP shards (P15).
    """
    placement = placement_fn(param) if callable(placement_fn) else None
    if placement is None:
        placement = Shard(0)
    elif not isinstance(placement, Shard):
        if type(placement).__name__ == "ShardPlacementResult":
            raise NotImplementedError(
                "The reference fully_shard does not support per-parameter meshes "
                "(ShardPlacementResult); return a Shard placement or None instead"
            )
        raise ValueError(f"Invalid shard_placement_fn result: {placement}")
    data = param._local_tensor if isinstance(param, DTensor) else param
    if not data.is_contiguous():
        raise NotImplementedError(
            "FSDP does not support non-contiguous parameters yet: "
            f"param.shape={data.shape} param.stride()={data.stride()}"
        )
    dim = placement.dim + data.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < data.ndim:
        raise AssertionError(f"Shard dim {dim} is invalid for {data.ndim}D tensor: {param.shape}")
    ws = mesh_info.shard_mesh_size
    if dim > 0 and data.size(dim) % ws != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {data.size()} (world size: {ws})"
        )
    return Shard(dim)
