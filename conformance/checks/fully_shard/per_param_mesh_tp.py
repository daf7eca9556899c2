"""Area "tensor_parallel": a per-parameter FSDP mesh over tensor-parallel parameters (P106).

[Note: the SPMD mesh of an FSDP + TP parameter]
``fully_shard`` over a parameter that is already a DTensor (tensor or expert parallel) shards its
local tensor over the FSDP mesh and describes the result on one combined (SPMD) mesh: the FSDP
mesh's dims followed by the TP mesh's, with the FSDP placement first. FSDP2 supports 2 to 4 such
dims (FSDP + TP/EP, FSDP + EP + TP or HSDP + TP/EP, HSDP + EP + TP) and refuses any other count
when it builds the parameter, also where a ``shard_placement_fn`` picks the parameter's FSDP mesh
(``ShardPlacementResult(placement, FSDPMeshInfo(mesh, shard_mesh_dim=0))``), which the unit's own
mesh check never sees. Here every mesh is a slice of one 5-D mesh of shape ``(ws, 1, 1, 1, 1)``
(dims ``a``-``e``): the TP mesh is ``("d", "e")`` (2-D), the unit's mesh ``"a"``; a per-parameter
FSDP mesh ``("a", "b", "c")`` makes 5 dims (refused), ``"a"`` makes 3 (accepted: each parameter's
``full_tensor()`` is then the original). Capabilities ``fsdp2-per-param-mesh``, ``tensor-parallel``.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import assert_close
from conformance.registry import check

NAMES = ("a", "b", "c", "d", "e")
REFUSAL = r"_spmd_mesh\.ndim can only be 2 .*but got 5"


def _tp_linear(ctx, root) -> tuple[nn.Linear, dict[str, torch.Tensor]]:
    """``Linear(4, 4)`` whose weight and bias are DTensors on ``root["d", "e"]`` (weight
    ``[Shard(0), Replicate()]``, bias replicated), and its original values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ctx.seed(0)
    lin = nn.Linear(4, 4).to(ctx.device)
    before = {n: p.detach().clone() for n, p in lin.named_parameters()}
    tp = root["d", "e"]
    placements = {"weight": [Shard(0), Replicate()], "bias": [Replicate(), Replicate()]}
    for name, value in before.items():
        dt = distribute_tensor(value.clone(), tp, placements[name])
        setattr(lin, name, nn.Parameter(dt))
    return lin, before


@check(
    area="tensor_parallel",
    requires={
        base.FSDP2_API,
        base.DTENSOR_PARAMS,
        base.TENSOR_PARALLEL,
        base.FSDP2_PER_PARAM_MESH,
    },
    world_sizes=(1, 2),
)
def per_param_mesh_tp_dims(ctx):
    """P106: ``fully_shard(m, mesh=root["a"], shard_placement_fn=...)`` over a ``Linear(4,4)``
    whose parameters are DTensors on the 2-D TP mesh ``root["d","e"]`` raises AssertionError
    "_spmd_mesh.ndim can only be 2 ..., 3 ... or 4 ... but got 5" when the function returns
    ``ShardPlacementResult(Shard(0), FSDPMeshInfo(root["a","b","c"], shard_mesh_dim=0))`` (a
    3-D FSDP mesh), and with ``FSDPMeshInfo(root["a"], ...)`` (3 dims in all) it is accepted and
    each parameter's ``full_tensor()`` is the original."""
    from torch.distributed.tensor import DTensor, Shard

    common = ns_module(ctx, "_fully_shard._fsdp_common")
    ns = ctx.impl.ns
    root = ctx.make_mesh((ctx.world_size, 1, 1, 1, 1), NAMES)

    def placed_on(mesh):
        info = common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        return lambda param: common.ShardPlacementResult(placement=Shard(0), mesh_info=info)

    lin, _ = _tp_linear(ctx, root)
    expect_error(
        ctx,
        "fully_shard with a 3-D per-parameter FSDP mesh over 2-D TP parameters (5 dims)",
        AssertionError,
        REFUSAL,
        lambda: ns.fully_shard(
            lin, mesh=root["a"], shard_placement_fn=placed_on(root["a", "b", "c"])
        ),
    )
    lin, before = _tp_linear(ctx, root)
    ns.fully_shard(lin, mesh=root["a"], shard_placement_fn=placed_on(root["a"]))
    for name, param in lin.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {name} after fully_shard is a {type(param).__name__}, expected a DTensor"
        )
        assert_close(
            ctx,
            f"{name}.full_tensor() (1-D FSDP mesh + 2-D TP)",
            param.full_tensor(),
            before[name],
            dict(rtol=0, atol=0),
        )
