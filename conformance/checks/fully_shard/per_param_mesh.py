"""Area "training": per-parameter meshes through ``shard_placement_fn`` (P60): they follow the
unit's ``reshard_after_forward`` (P80), and one process group needs one ``FSDPMeshInfo`` (P104).

[Note: two parameter groups per unit]
``shard_placement_fn`` may return ``ShardPlacementResult(placement, mesh_info)`` with an
``FSDPMeshInfo(mesh, shard_mesh_dim=0)``: that parameter is sharded over ``mesh`` instead of the
unit's mesh, and the unit's parameters are split into one group per process group, each with its
own all-gather and reduce-scatter (the unit's default-mesh group first, in parameter order). Here
each block of a three-block chain has a ``dense`` Linear on the world mesh and an ``expert`` Linear
on a second mesh over the same ranks (a process group of its own), so every block has two groups and
training still equals the unsharded model's.

[Note: backward prefetch of a unit's groups]
In a unit's pre-backward FSDP all-gathers its own groups in order, then (implicit prefetch, no
``set_modules_to_backward_prefetch``) every group of the unit that ran just before it in forward,
last group first, before the unit's own backward computation runs. A marker function at the end of
each block's forward records when autograd reaches that block's backward, and the spy records each
all-gather by its output size (``prefetch.py``'s sizes, distinct for the six groups at ws 2), so
the backward of blocks b0, b1, b2 (resharded after forward) shows ``b2.dense, b2.expert,
b1.expert, b1.dense, <b2>, b0.expert, b0.dense, <b1>, <b0>``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.adapters import base
from conformance.checks._shared.collectives import is_all_gather, output_numel
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import B, make_optimizer, step_and_compare
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.bad_input import _assert_untouched, _snapshot
from conformance.checks.fully_shard.edges import Pair
from conformance.checks.fully_shard.prefetch import gathered_numel
from conformance.registry import check

HIDDEN = (2, 6, 10)  # block k: dense Linear(4, h) -> tanh -> expert Linear(h, 4)


class Mark(torch.autograd.Function):
    """Identity whose backward appends ``label`` to ``log``."""

    @staticmethod
    def forward(ctx, x, log, label):
        ctx.log, ctx.label = log, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.label)
        return grad, None, None


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense = nn.Linear(4, hidden)
        self.expert = nn.Linear(hidden, 4)
        self.log: list | None = None
        self.label = ""

    def forward(self, x):
        y = torch.tanh(self.expert(torch.tanh(self.dense(x))))
        return y if self.log is None else Mark.apply(y, self.log, f"<{self.label}>")


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for h in HIDDEN)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Spy(TorchDispatchMode):
    """Appends each all-gather's unit name (by output size) to ``log``."""

    def __init__(self, log: list, sizes: dict):
        super().__init__()
        self.log, self.sizes = log, sizes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if is_all_gather(name):
            n = output_numel(name, args, result)
            self.log.append(self.sizes.get(n, f"<{n} elements>"))
        return result


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_PER_PARAM_MESH},
    world_sizes=(2,),
)
def per_param_mesh(ctx):
    """P60: ``shard_placement_fn`` returning ``ShardPlacementResult(Shard(0), FSDPMeshInfo(mesh2,
    shard_mesh_dim=0))`` for each block's ``expert`` parameters shards them over ``mesh2`` (another
    process group over the same ranks: ``Shard(0)``, chunk ``rank`` of ws) in a group of their
    own, gathered apart from the ``dense`` ones (the spy tells the two by size); backward
    all-gathers come in the module Note's order (each unit's two groups, then the previous unit's
    prefetched, last group first, before the unit's backward runs); two SGD steps give the
    oracle's parameters. On a unit
    of two groups ``set_custom_all_gather``, ``set_custom_reduce_scatter`` and
    ``set_all_reduce_hook`` raise ValueError "... not supported with multiple param groups ..."."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    common = ns_module(ctx, "_fully_shard._fsdp_common")
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,))
    # a second mesh over the same ranks with a process group of its own (a 1-D mesh from
    # init_device_mesh over every rank would reuse the default group)
    mesh2 = DeviceMesh.from_group(dist.new_group(list(range(ws))), ctx.device.type)
    expert_info = common.FSDPMeshInfo(mesh2, shard_mesh_dim=0)

    def placement_fn(param):
        if any(param is p for b in model.blocks for p in b.expert.parameters()):
            return common.ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return None

    ctx.seed(0)
    oracle = Chain().to(ctx.device)
    model = copy.deepcopy(oracle)
    for block in model.blocks:
        ctx.impl.ns.fully_shard(
            block, mesh=mesh, reshard_after_forward=True, shard_placement_fn=placement_fn
        )
    ctx.impl.ns.fully_shard(model, mesh=mesh)
    sizes = {}
    for k, block in enumerate(oracle.blocks):
        for part in ("dense", "expert"):
            sizes[gathered_numel(getattr(block, part), ws)] = f"b{k}.{part}"
    assert len(sizes) == 2 * len(HIDDEN), f"{ctx.where()} setup: sizes collide {sizes}"

    for fqn, param in model.named_parameters():
        got = (
            (param.device_mesh.size(), tuple(param.placements))
            if isinstance(param, DTensor)
            else None
        )
        assert got == (ws, (Shard(0),)), f"{ctx.where()} {fqn}: (mesh size, placements) {got}"
        assert torch.equal(param.to_local(), chunk_of(oracle.get_parameter(fqn), 0, ws, rank)), (
            f"{ctx.where()} {fqn}: local shard is not chunk {rank} of {ws}"
        )

    for setter in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook"):
        try:
            getattr(model.blocks[0], setter)(None)
        except ValueError as exc:
            assert "multiple param groups" in str(exc), f"{ctx.where()} {setter}: {exc!r}"
        else:
            raise AssertionError(f"{ctx.where()} {setter} accepted a unit of two groups")

    log: list = []
    for k, block in enumerate(model.blocks):
        block.log, block.label = log, f"b{k}"
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    want = ["b2.dense", "b2.expert", "b1.expert", "b1.dense", "<b2>"]
    want += ["b0.expert", "b0.dense", "<b1>", "<b0>"]
    for step in range(2):
        g = torch.Generator().manual_seed(80 + step)
        x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
        loss = model(x[rank * B : (rank + 1) * B]).square().mean()
        log.clear()
        with Spy(log, sizes):
            loss.backward()
        assert log == want, f"{ctx.where()} step {step}: backward order {log}, expected {want}"
        oracle(x).square().mean().backward()
        step_and_compare(ctx, model, oracle, opts, step)


class Duo(nn.Module):
    """``dense`` Linear(4, 6) -> tanh -> ``expert`` Linear(6, 4)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 6)
        self.expert = nn.Linear(6, 4)

    def forward(self, x):
        return torch.tanh(self.expert(torch.tanh(self.dense(x))))


class Top(nn.Module):
    """Two ``Duo`` units and a ``head`` Linear(4, 4) owned by the root itself."""

    def __init__(self):
        super().__init__()
        self.first = Duo()
        self.second = Duo()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def _is_sharded(param) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_PER_PARAM_MESH},
    world_sizes=(1,),
)
def per_param_mesh_reshard_default(ctx):
    """P80: with ``shard_placement_fn`` putting every ``expert`` parameter and the root's ``head``
    weight on a second mesh (``ShardPlacementResult(Shard(0), FSDPMeshInfo(mesh2,
    shard_mesh_dim=0))``, a group of its own), ``fully_shard(first)`` without
    ``reshard_after_forward``, ``fully_shard(second, reshard_after_forward=False)`` and the root
    without it all succeed; right after a training forward every parameter of ``first`` (both
    groups) is registered sharded (a DTensor), every one of ``second`` and of the root unsharded
    (a plain tensor); after the backward all are sharded again, and the SGD step equals the
    unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    ns = ctx.impl.ns
    common = ns_module(ctx, "_fully_shard._fsdp_common")
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,))
    mesh2 = DeviceMesh.from_group(dist.new_group(list(range(ws))), ctx.device.type)
    other = common.FSDPMeshInfo(mesh2, shard_mesh_dim=0)

    ctx.seed(0)
    oracle = Top().to(ctx.device)
    model = copy.deepcopy(oracle)
    moved = {id(p) for duo in (model.first, model.second) for p in duo.expert.parameters()}
    moved.add(id(model.head.weight))

    def placement_fn(param):
        if id(param) in moved:
            return common.ShardPlacementResult(placement=Shard(0), mesh_info=other)
        return None

    ns.fully_shard(model.first, mesh=mesh, shard_placement_fn=placement_fn)
    ns.fully_shard(
        model.second, mesh=mesh, shard_placement_fn=placement_fn, reshard_after_forward=False
    )
    ns.fully_shard(model, mesh=mesh, shard_placement_fn=placement_fn)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    g = torch.Generator().manual_seed(80)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    loss = model(x[rank * B : (rank + 1) * B]).square().mean()
    for fqn, param in model.named_parameters():
        want = fqn.startswith("first.")  # non-root, default: resharded after forward
        assert _is_sharded(param) == want, (
            f"{ctx.where()} after forward {fqn} is registered "
            f"{'sharded' if _is_sharded(param) else 'unsharded'}, expected "
            f"{'sharded' if want else 'unsharded'} (first: default, second: False, root: default)"
        )
    loss.backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert _is_sharded(param), f"{ctx.where()} after backward {fqn} is not sharded"
    step_and_compare(ctx, model, oracle, opts, 0)


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.FSDP2_PER_PARAM_MESH},
    world_sizes=(1, 2),
)
def per_param_mesh_info_objects_refused(ctx):
    """P104: a ``shard_placement_fn`` returning ``ShardPlacementResult(Shard(0),
    FSDPMeshInfo(mesh, shard_mesh_dim=0))`` with a new ``FSDPMeshInfo`` object per parameter
    (the same mesh, so the same process group) makes ``fully_shard`` raise ValueError "Params
    sharing the same process group must use the same FSDPMeshInfo object ..." and shard nothing
    (no ``FSDPModule``, parameters unchanged)."""
    common = ns_module(ctx, "_fully_shard._fsdp_common")
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((ctx.world_size,))
    ctx.seed(0)
    module = Pair().to(ctx.device)
    before = _snapshot(module)

    def placement_fn(param):
        info = common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        return common.ShardPlacementResult(placement=Shard(0), mesh_info=info)

    expect_error(
        ctx,
        "fully_shard(shard_placement_fn=<a new FSDPMeshInfo per parameter>)",
        ValueError,
        r"Params sharing the same process group must use the same FSDPMeshInfo object",
        lambda: ns.fully_shard(module, mesh=mesh, shard_placement_fn=placement_fn),
    )
    _assert_untouched(ctx, ns, module, before, "refused per-parameter mesh infos")
