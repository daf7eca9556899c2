"""Parax: a small DTensor-based per-parameter FSDP that all-gathers through parametrizations.

[Note: how Parax shards]
``shard_unit(module, mesh)`` replaces every parameter the unit owns (those of its subtree that no
inner unit took) by a ``Shard(0)`` DTensor parameter on the 1-D mesh and registers a
parametrization (``torch.nn.utils.parametrize``) on the owning module: every read of
``module.weight`` then runs :class:`Gather`, which all-gathers the rows with a functional
collective (``all_gather_tensor``) and returns a plain tensor of the full shape. Its backward
reduce-scatters the gradient with ``reduce_scatter_tensor`` (functional collectives, not
``torch.distributed``) and divides it by the world size, so the sharded DTensor parameter's
``.grad`` is this rank's rows of the gradient averaged over the ranks.

Rows follow ``torch.chunk``: rank r holds rows ``[r*c, (r+1)*c)`` of ``c = ceil(d0/ws)`` (the
DTensor ``Shard(0)`` layout); the collectives run on ``c`` rows per rank, zero-padded.

Mixed precision (``param_dtype``, ``reduce_dtype``): the rows are cast to ``param_dtype`` before
the all-gather, the unit's floating-point forward inputs are cast to it, and the gradient is cast
to ``reduce_dtype or param_dtype`` before the reduce-scatter; the shards and their gradients stay
in the original dtype. A ``param_dtype`` equal to the original dtype, or a non-floating
parameter, is left alone.

Not upstream's API: no ``FSDPModule``, no unshard/reshard, no reshard-after-forward (the full
tensor lives only inside one parameter read), no CPU offload, no HSDP.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.utils import parametrize


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


class _AllGatherRows(torch.autograd.Function):
    """Forward: the full tensor from every rank's rows; backward: the reduce-scattered, averaged
    gradient of this rank's rows."""

    @staticmethod
    def forward(ctx, local, rows, compute_dtype, reduce_dtype, mesh):
        ws = mesh.size()
        chunk = -(-rows // ws)
        ctx.rows, ctx.local_rows, ctx.chunk, ctx.ws = rows, local.shape[0], chunk, ws
        ctx.reduce_dtype, ctx.orig_dtype, ctx.mesh = reduce_dtype, local.dtype, mesh
        padded = local.new_zeros((chunk, *local.shape[1:]), dtype=compute_dtype)
        padded[: local.shape[0]] = local
        full = _waited(funcol.all_gather_tensor(padded, 0, mesh.get_group()))
        return full[:rows].clone()

    @staticmethod
    def backward(ctx, grad):
        padded = grad.new_zeros((ctx.chunk * ctx.ws, *grad.shape[1:]), dtype=ctx.reduce_dtype)
        padded[: ctx.rows] = grad
        mine = _waited(funcol.reduce_scatter_tensor(padded, "sum", 0, ctx.mesh.get_group()))
        mine = mine[: ctx.local_rows] / ctx.ws
        return mine.to(ctx.orig_dtype), None, None, None, None


class Gather(nn.Module):
    """The parametrization: the sharded DTensor parameter in, the full plain tensor out."""

    def __init__(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        super().__init__()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def forward(self, sharded: DTensor) -> torch.Tensor:
        local, orig = sharded.to_local(), sharded.dtype
        compute = orig
        if orig.is_floating_point and self.param_dtype is not None:
            compute = self.param_dtype
        reduce = self.reduce_dtype if orig.is_floating_point and self.reduce_dtype else compute
        return _AllGatherRows.apply(local, sharded.shape[0], compute, reduce, sharded.device_mesh)


def _cast_inputs(dtype):
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    def hook(module, args, kwargs):
        return cast(args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def owned_parameters(unit: nn.Module, taken: set[int]) -> list[list[tuple[nn.Module, str]]]:
    """The parameters of ``unit``'s subtree not yet in ``taken`` (ids), each as the list of
    (module, name) that hold it (a tied parameter is held by several)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in unit.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) not in taken:
                holders.setdefault(id(param), []).append((module, name))
    taken.update(holders)
    return list(holders.values())


def shard_unit(
    unit: nn.Module,
    mesh,
    owned: list[list[tuple[nn.Module, str]]],
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Shard ``owned`` (from :func:`owned_parameters`) over ``mesh`` and gather them on read; the
    holders of a tied parameter share one sharded parameter."""
    for holders in owned:
        module, name = holders[0]
        param = module._parameters[name]
        if param.dim() == 0:
            raise ValueError(f"parax cannot shard the 0-dim parameter {name!r} (it shards dim 0)")
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
        sharded = nn.Parameter(sharded, requires_grad=param.requires_grad)
        for module, name in holders:
            module._parameters[name] = sharded
            parametrize.register_parametrization(
                module, name, Gather(param_dtype, reduce_dtype), unsafe=True
            )
    if param_dtype is not None:
        unit.register_forward_pre_hook(_cast_inputs(param_dtype), with_kwargs=True)


def clean_name(name: str) -> str:
    """``l1.parametrizations.weight.original`` -> ``l1.weight``; ``l1.parametrizations`` and
    ``l1.parametrizations.weight`` (the parametrization modules) -> ``l1``."""
    parts = name.split(".")
    out, i = [], 0
    while i < len(parts):
        if parts[i] == "parametrizations":
            if i + 2 < len(parts) and parts[i + 2] == "original":
                out.append(parts[i + 1])
            i += 3
            continue
        out.append(parts[i])
        i += 1
    return ".".join(out)
