"""FSDP2 contracts on paths that no other case runs (P98-P105): refusals of ``fully_shard``'s
arguments (a container without ``forward``; ``dp_mesh_dims`` naming no dim, on a mesh without dim
names, or asking for replication with a ``shard_placement_fn``; a new ``FSDPMeshInfo`` per
parameter for one process group), ``dp_mesh_dims`` names given as tuples, a custom reduce-scatter
refusing the process group's allocator, a module's own ``__setattr__`` used for the parameter
swaps, post-accumulate-grad hooks on sharded parameters, and an all-gather extension whose pre
hook does not pad an uneven shard.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from conformance.adapters import base
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close, assert_sharded_grad
from conformance.checks._shared.rows import chunk_of, chunk_size
from conformance.checks.fully_shard._subclasses import Pair5
from conformance.checks.fully_shard.custom_comms import CountingReduceScatter
from conformance.checks.fully_shard.edges import OnMesh, Pair
from conformance.checks.fully_shard.extensions import PairLinear
from conformance.registry import check

DIMS = {base.FSDP2_API, base.DTENSOR_PARAMS, base.FSDP2_DP_MESH_DIMS}


def _snapshot(module):
    """name -> (type, placements or None, full values) of ``module``'s parameters."""
    return {
        n: (
            type(p),
            getattr(p, "placements", None),
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(),
        )
        for n, p in module.named_parameters()
    }


def _assert_untouched(ctx, ns, module, before, what):
    """A refused ``fully_shard`` leaves no ``FSDPModule`` and the parameters as they were."""
    assert not isinstance(module, ns.FSDPModule), f"{ctx.where()} {what}: became an FSDPModule"
    for name, (kind, placements, values) in _snapshot(module).items():
        was = before[name]
        assert (kind, placements) == was[:2], (
            f"{ctx.where()} {what}: {name} is a {kind.__name__} {placements}, was a "
            f"{was[0].__name__} {was[1]}"
        )
        assert torch.equal(values, was[2]), f"{ctx.where()} {what}: {name} changed its values"


class Stack(nn.ModuleList):
    """A ``ModuleList`` that implements ``forward`` (its layers in turn)."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


@check(area="lifecycle", requires={base.FSDP2_API}, world_sizes=(1,))
def container_without_forward_refused(ctx):
    """P98: ``fully_shard`` of an ``nn.ModuleList`` or ``nn.ModuleDict`` (containers that do not
    implement ``forward``) raises ValueError "fully_shard does not support containers that do not
    implement forward" and shards nothing (no ``FSDPModule``, parameters unchanged); a
    ``ModuleList`` subclass that implements ``forward`` is sharded."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((ctx.world_size,))
    ctx.seed(0)
    containers = {
        "nn.ModuleList": nn.ModuleList([nn.Linear(4, 4)]),
        "nn.ModuleDict": nn.ModuleDict({"lin": nn.Linear(4, 4)}),
    }
    for what, container in containers.items():
        before = _snapshot(container)
        expect_error(
            ctx,
            f"fully_shard({what})",
            ValueError,
            r"fully_shard does not support containers that do not implement forward",
            lambda container=container: ns.fully_shard(container.to(ctx.device), mesh=mesh),
        )
        _assert_untouched(ctx, ns, container, before, what)
    stack = Stack([nn.Linear(4, 4)]).to(ctx.device)
    ns.fully_shard(stack, mesh=mesh)
    assert isinstance(stack, ns.FSDPModule), (
        f"{ctx.where()} a ModuleList subclass with forward was not sharded"
    )


def _cleared(ns):
    """``DataParallelMeshDims(shard="dp")`` whose ``shard`` is cleared after construction."""
    dims = ns.DataParallelMeshDims(shard="dp")
    dims.shard = None
    return dims


DIMS_REFUSALS = {
    # name: (mesh dim names, DataParallelMeshDims builder, extra kwargs, message)
    "cleared-dims": (
        ("dp", "tp"),
        _cleared,
        {},
        r"At least one of shard or replicate must be set",
    ),
    "unnamed-mesh": (
        None,
        lambda ns: ns.DataParallelMeshDims(shard="dp"),
        {},
        r"mesh must have mesh_dim_names when dp_mesh_dims is provided",
    ),
    "replicate-with-placement-fn": (
        ("dp", "tp"),
        lambda ns: ns.DataParallelMeshDims(replicate="dp"),
        {"shard_placement_fn": lambda param: Shard(0)},
        r"Per-param mesh via shard_placement_fn is not supported",
    ),
}


@check(
    area="training",
    requires=DIMS,
    cases={n: {"name": n} for n in DIMS_REFUSALS},
    world_sizes=(1, 2),
)
def dp_mesh_dims_argument_refused(ctx, name):
    """P99: ``fully_shard(module, mesh=<(ws, 1) mesh>, dp_mesh_dims=...)`` over parameters that are
    DTensors replicated on that mesh raises ValueError, shards nothing and leaves the parameters'
    placements and values: a ``DataParallelMeshDims`` whose ``shard`` was cleared after
    construction ("At least one of shard or replicate must be set ..."), a mesh without dim names
    ("mesh must have mesh_dim_names when dp_mesh_dims is provided"), or replication only
    (``replicate="dp"``) with a ``shard_placement_fn`` ("Per-param mesh via shard_placement_fn is
    not supported ...")."""
    ns = ctx.impl.ns
    names, make_dims, extra, message = DIMS_REFUSALS[name]
    mesh = ctx.make_mesh((ctx.world_size, 1), names)
    ctx.seed(0)
    module = OnMesh(Pair().to(ctx.device), mesh, None)
    before = _snapshot(module)
    expect_error(
        ctx,
        f"fully_shard(dp_mesh_dims=...) [{name}]",
        ValueError,
        message,
        lambda: ns.fully_shard(module, mesh=mesh, dp_mesh_dims=make_dims(ns), **extra),
    )
    _assert_untouched(ctx, ns, module, before, name)


@check(area="training", requires=DIMS, world_sizes=(2,))
def dp_mesh_dims_tuple_names(ctx):
    """P100: ``DataParallelMeshDims(shard=("s",), replicate=("r",))`` (one-name tuples) means the
    same as ``DataParallelMeshDims(shard="s", replicate="r")``: its ``shard_names`` /
    ``replicate_names`` are ``("s",)`` / ``("r",)``, and ``fully_shard`` on an ``("r", "s")`` mesh
    of shape (1, 2) gives every parameter the placements, local tensor and full value that the
    bare names give."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((1, 2), ("r", "s"))
    tupled = ns.DataParallelMeshDims(shard=("s",), replicate=("r",))
    got = (tupled.shard_names, tupled.replicate_names)
    assert got == (("s",), ("r",)), f"{ctx.where()} shard/replicate names {got}"
    ctx.seed(0)
    pair = Pair().to(ctx.device)
    models = {}
    for what, dims in (
        ("tuples", tupled),
        ("names", ns.DataParallelMeshDims(shard="s", replicate="r")),
    ):
        model = OnMesh(copy.deepcopy(pair), mesh, None)
        for unit in (model.inp, model.out, model):
            ns.fully_shard(unit, mesh=mesh, dp_mesh_dims=dims)
        models[what] = model
    for (fqn, param), (_, want) in zip(
        models["tuples"].named_parameters(), models["names"].named_parameters()
    ):
        assert param.placements == want.placements, (
            f"{ctx.where()} {fqn}: placements {param.placements} with tuples, "
            f"{want.placements} with names"
        )
        assert torch.equal(param.to_local(), want.to_local()), f"{ctx.where()} {fqn}: local differs"
        assert torch.equal(param.full_tensor(), want.full_tensor()), (
            f"{ctx.where()} {fqn}: full value differs"
        )


@check(
    area="training",
    requires={base.FSDP2_API, base.TRAINING, base.FSDP2_CUSTOM_COMMS},
    world_sizes=(2,),
)
def custom_reduce_scatter_excludes_pg_allocator(ctx):
    """P101: a unit with a custom reduce-scatter (``set_custom_reduce_scatter(comm)``) refuses
    ``set_allocate_memory_from_process_group_for_comm(True)``: AssertionError "cannot call
    set_allocate_memory_from_process_group() when reduce scatter comm is custom: <comm's class>";
    the custom reduce-scatter stays in use (a backward calls it)."""
    ctx.seed(0)
    model = Pair().to(ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.make_mesh((ctx.world_size,)))
    comm = CountingReduceScatter()
    model.set_custom_reduce_scatter(comm)
    expect_error(
        ctx,
        "set_allocate_memory_from_process_group_for_comm(True) after set_custom_reduce_scatter",
        AssertionError,
        r"cannot call set_allocate_memory_from_process_group\(\) when reduce scatter comm is "
        r"custom: CountingReduceScatter",
        lambda: model.set_allocate_memory_from_process_group_for_comm(True),
    )
    model(torch.ones(B, 4, device=ctx.device)).sum().backward()
    assert comm.calls > 0, f"{ctx.where()} the custom reduce-scatter was not used after the refusal"


SETATTR_LOG: list = []  # (id of the module, name) of every Parameter assigned to a RecordingLinear


class RecordingLinear(nn.Linear):
    """``nn.Linear`` whose ``__setattr__`` records each parameter assigned (then assigns as usual)."""

    def __setattr__(self, name, value):
        if isinstance(value, nn.Parameter):
            SETATTR_LOG.append((id(self), name))
        super().__setattr__(name, value)


class RecordingPair(Pair):
    """``Pair`` built of ``RecordingLinear``s holding ``pair``'s values."""

    def __init__(self, pair: Pair):
        super().__init__()
        self.inp, self.out = RecordingLinear(4, 8), RecordingLinear(8, 4)
        self.load_state_dict(pair.state_dict())


@check(area="training", requires={base.FSDP2_API, base.TRAINING, base.DTENSOR_PARAMS})
def module_setattr_override_used(ctx):
    """P102: for a module whose class overrides ``__setattr__``, FSDP swaps the sharded and
    unsharded parameters through that override (each of its ``weight`` and ``bias`` passes through
    it during a forward and backward, on both Linears of ``Pair`` sharded at the root), and the
    output and sharded gradients equal the unsharded model's."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = RecordingPair(oracle).to(ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.make_mesh((ws,)))
    SETATTR_LOG.clear()
    g = torch.Generator().manual_seed(102)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    mine = slice(rank * B, (rank + 1) * B)
    out = model(x[mine])
    assert_close(ctx, "forward output", out, oracle(x[mine]), FP32["param"])
    out.square().mean().backward()
    torch.stack(
        [oracle(x[r * B : (r + 1) * B]).square().mean() for r in range(ws)]
    ).mean().backward()
    for linear in (model.inp, model.out):
        for pname in ("weight", "bias"):
            assert (id(linear), pname) in SETATTR_LOG, (
                f"{ctx.where()} {pname} of a Linear never passed through its __setattr__; "
                f"seen: {sorted({n for _, n in SETATTR_LOG})}"
            )
    for fqn, param in model.named_parameters():
        assert_sharded_grad(ctx, f"{fqn} sharded gradient", param, oracle.get_parameter(fqn).grad)


@check(area="training", requires={base.FSDP2_API, base.TRAINING, base.DTENSOR_PARAMS})
def post_accumulate_grad_hook_sharded(ctx):
    """P103: a ``register_post_accumulate_grad_hook`` hook on a sharded parameter runs once per
    backward, after FSDP has set the parameter's ``.grad`` to the reduced sharded gradient (a
    DTensor whose local tensor is this rank's chunk of the gradient averaged over the ranks'
    slices)."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model.inp, model.out, model):
        ctx.impl.ns.fully_shard(unit, mesh=ctx.make_mesh((ws,)))
    seen: dict[str, list] = {fqn: [] for fqn, _ in model.named_parameters()}
    for fqn, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, fqn=fqn: seen[fqn].append(
                p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad
            )
        )
    g = torch.Generator().manual_seed(103)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    torch.stack(
        [oracle(x[r * B : (r + 1) * B]).square().mean() for r in range(ws)]
    ).mean().backward()
    for fqn, grads in seen.items():
        assert len(grads) == 1, f"{ctx.where()} {fqn}: hook ran {len(grads)} times, expected 1"
        assert isinstance(grads[0], torch.Tensor), (
            f"{ctx.where()} {fqn}: the hook saw .grad {grads[0]!r}, expected the sharded DTensor"
        )
        assert_close(
            ctx,
            f"{fqn} .grad seen by its post-accumulate-grad hook",
            grads[0],
            chunk_of(oracle.get_parameter(fqn).grad, 0, ws, rank),
            FP32["grad"],
        )


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


class Unpadded5(Pair5):
    """``Pair5`` whose 5-argument pre hook hands FSDP its local shard as it is, never padded."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), {"rows": outer_size[0]}


@check(area="extensions", requires={base.EXTENSIONS, base.FSDP2_API}, world_sizes=(2,))
def unpadded_all_gather_inputs_refused(ctx):
    """P105: for a parameter unevenly sharded on dim 0 (``PairLinear`` of 2 * ws + 1 rows), an
    ``fsdp_pre_all_gather`` (5-argument form) returning all-gather inputs of the unpadded local
    size is refused on each rank whose shard is padded: ``unit.unshard()`` raises AssertionError
    "When a parameter is unevenly sharded by FSDP (orig size=..., FSDP world size=<ws>),
    fsdp_pre_all_gather must return all-gather inputs with the padded sharded size ...", before
    any communication (only those ranks call it; the others hold a full shard)."""
    ws = ctx.world_size
    rows = 2 * ws + 1
    module = PairLinear(rows, Unpadded5).to(ctx.device)
    ctx.impl.ns.fully_shard(module, mesh=ctx.mesh)
    if module.weight.to_local().shape[0] == chunk_size(rows, ws):
        return  # a full shard: nothing to pad, and no rank to all-gather with
    expect_error(
        ctx,
        "unshard() with unpadded all-gather inputs",
        AssertionError,
        rf"When a parameter is unevenly sharded by FSDP \(orig size=.*FSDP world size={ws}\), "
        r"fsdp_pre_all_gather must return all-gather inputs with the padded sharded size",
        module.unshard,
    )
