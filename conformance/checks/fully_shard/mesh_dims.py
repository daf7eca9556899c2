"""Area "training": ``fully_shard(dp_mesh_dims=DataParallelMeshDims(...))`` on a full SPMD mesh
(P40, P41, P79), names given as one-name tuples (P100), the arguments it refuses (P93, P99), and the
shard-group setters a replicate-only unit refuses (P126).

[Note: the SPMD mesh]
With ``dp_mesh_dims`` the ``mesh`` passed to ``fully_shard`` is the whole SPMD mesh and every
parameter is already a DTensor on it, ``Replicate()`` on each data-parallel dim; the
``DataParallelMeshDims`` names which dims are data parallel: ``shard=`` the dim FSDP shards on,
``replicate=`` the dim it replicates over (HSDP). Three cases, each on a (2, ws/2) mesh:

* ``shard="dp"`` on ``("dp", "tp")``: the parameter becomes ``(Shard(0), Replicate())``, rank r
  holding chunk ``dp(r)`` of 2 (``dp(r) = r // (ws/2)``); the ranks of one ``dp`` index form one
  data-parallel replica and feed the same samples (those of index ``dp(r)``), so the gradient is
  averaged over the 2 dp indices only.
* ``shard="dp", replicate="rep"`` on ``("rep", "dp")``: ``(Replicate(), Shard(0))``, chunk
  ``r % (ws/2)`` of ``ws/2``; every rank feeds its own samples and the gradient is averaged over
  all ws ranks (HSDP, P16).
* ``replicate="dp"`` alone on ``("dp", "tp")`` (P79): nothing is sharded, ``(Replicate(),
  Replicate())``, the local tensor the whole parameter (unsharding copies it, no all-gather);
  the replicas are the dp indices as in the first case.

The model wraps its input and output so that the forward computes on DTensors of the mesh (inputs
``Replicate()`` everywhere, as ``distribute_module`` would hand them), and the oracle is the plain
model on the global batch. A fourth case, ``shard-split`` (P40), is ``shard`` with each replica's
samples split over ``"tp"`` (input ``Shard(0)`` there, output gathered back): a parameter
``Replicate()`` on ``"tp"`` then gets a gradient that is ``Partial()`` on ``"tp"``, which FSDP
must reduce to the parameter's placement before its reduce-scatter over ``"dp"``; the expected
gradient is the same as ``shard``'s.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    B,
    assert_close,
    make_batch,
    make_optimizer,
    per_sample_loss,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.bad_input import _assert_untouched, _snapshot
from conformance.checks.fully_shard.edges import OnMesh, Pair, assert_dp_grads, dp_dims_pair
from conformance.registry import check

REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_DP_MESH_DIMS}


class SpmdMLP(nn.Module):
    """The oracle MLP computing on DTensors of ``mesh``: the input enters replicated on every
    dim, the output leaves as this rank's local tensor. With ``split`` (a mesh dim's index) the
    input enters ``Shard(0)`` on that dim instead, each rank there holding its chunk of the
    samples, and the output is gathered back (``Replicate()`` everywhere) before it leaves."""

    def __init__(self, mlp: MLP, mesh, split: int | None = None):
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.mesh, self.split = mesh, split
        self.inp, self.out = mlp.inp, mlp.out
        for module in (self.inp, self.out):
            for name, param in list(module.named_parameters()):
                full = distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim)
                setattr(module, name, nn.Parameter(full))

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        everywhere = [Replicate()] * self.mesh.ndim
        if self.split is None:
            x = DTensor.from_local(x, self.mesh, everywhere, run_check=False)
            return self.out(torch.tanh(self.inp(x))).to_local()
        size, index = self.mesh.size(self.split), self.mesh.get_local_rank(self.split)
        placements = [
            Shard(0) if dim == self.split else Replicate() for dim in range(self.mesh.ndim)
        ]
        x = DTensor.from_local(x.chunk(size)[index], self.mesh, placements, run_check=False)
        return self.out(torch.tanh(self.inp(x))).redistribute(self.mesh, everywhere).to_local()


CASES = {
    # name: (mesh dim names, DataParallelMeshDims kwargs)
    "shard": (("dp", "tp"), {"shard": "dp"}),
    "shard-replicate": (("rep", "dp"), {"shard": "dp", "replicate": "rep"}),
    # P79: no shard dim, replicate only (DDP over "dp")
    "replicate": (("dp", "tp"), {"replicate": "dp"}),
    # P40: as "shard", the samples split over "tp" (the gradient leaves the model Partial there)
    "shard-split": (("dp", "tp"), {"shard": "dp"}),
}


@check(
    area="training", requires=REQUIRES, cases={n: {"name": n} for n in CASES}, world_sizes=(2, 4)
)
def dp_mesh_dims_training(ctx, name):
    """P40 (``shard="dp"`` on ``("dp", "tp")``, also with the samples split over ``"tp"``), P41 (``shard="dp", replicate="rep"`` on
    ``("rep", "dp")``), P79 (``replicate="dp"`` alone on ``("dp", "tp")``: every dim
    ``Replicate()``, the local tensor the whole parameter): after ``fully_shard(unit, mesh=spmd_mesh, dp_mesh_dims=...)`` on ``inp``,
    ``out`` and the root, every parameter is a DTensor on the full mesh with ``Shard(0)`` on the
    shard dim and ``Replicate()`` elsewhere, its local tensor the rank's chunk over the shard dim;
    two SGD steps give sharded gradients equal to the oracle's chunks of the gradient averaged
    over the data-parallel replicas (see the module Note) and parameters equal to its."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ns = ctx.impl.ns
    names, dims = CASES[name]
    ws, rank = ctx.world_size, ctx.rank
    half = ws // 2
    mesh = ctx.make_mesh((2, half), names)
    shard_axis = names.index("dp") if "shard" in dims else None
    if name == "replicate":
        parts, index = 1, 0  # nothing sharded: the local tensor is the whole parameter
        replica, replicas = rank // half, 2
    elif name in ("shard", "shard-split"):
        parts, index = 2, rank // half
        replica, replicas = rank // half, 2  # one replica per dp index
    else:
        parts, index = half, rank % half
        replica, replicas = rank, ws
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = SpmdMLP(
        copy.deepcopy(oracle), mesh, names.index("tp") if name == "shard-split" else None
    )
    mesh_dims = ns.DataParallelMeshDims(**dims)
    for unit in (model.inp, model.out, model):
        ns.fully_shard(unit, mesh=mesh, dp_mesh_dims=mesh_dims)
    expected_placements = tuple(
        Shard(0) if axis == shard_axis else Replicate() for axis in range(2)
    )
    for fqn, param in model.named_parameters():
        assert isinstance(param, DTensor) and tuple(param.placements) == expected_placements, (
            f"{ctx.where()} {fqn}: {type(param).__name__} "
            f"{getattr(param, 'placements', None)}, expected a DTensor {expected_placements}"
        )
        assert_close(
            ctx,
            f"{fqn} local shard (chunk {index} of {parts})",
            param.to_local(),
            chunk_of(oracle.get_parameter(fqn), 0, parts, index),
            FP32["param"],
        )
    opt = make_optimizer("sgd", model.parameters())
    oopt = make_optimizer("sgd", oracle.parameters())
    mine = slice(replica * B, (replica + 1) * B)
    for step in range(2):
        x, y = make_batch("mlp", replicas, step, ctx.device)
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        for fqn, param in model.named_parameters():
            assert_close(
                ctx,
                f"step {step}: {fqn} sharded gradient (the oracle's chunk {index} of {parts}, "
                f"averaged over {replicas} replicas)",
                param.grad.to_local(),
                chunk_of(oracle.get_parameter(fqn).grad, 0, parts, index),
                FP32["grad"],
            )
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        for fqn, param in model.named_parameters():
            assert_close(
                ctx,
                f"{fqn} after step {step}",
                param.detach().full_tensor(),
                oracle.get_parameter(fqn),
                FP32["param"],
            )


@check(
    area="training",
    requires={base.FSDP2_API, base.FSDP2_DP_MESH_DIMS},
    cases={
        "neither": {"kwargs": {}, "text": "At least one of shard or replicate must be set"},
        "unknown-dim": {"kwargs": {"shard": "nope"}, "text": "Mesh dim name 'nope' not found"},
    },
    world_sizes=(2,),
)
def dp_mesh_dims_rejects(ctx, kwargs, text):
    """P40: ``DataParallelMeshDims()`` with neither field raises ValueError "At least one of shard
    or replicate must be set ..."; a name the mesh lacks (``shard="nope"``) makes ``fully_shard``
    raise ValueError "Mesh dim name 'nope' not found in mesh.mesh_dim_names ..."."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((2, 1), ("dp", "tp"))
    ctx.seed(0)
    model = SpmdMLP(MLP().to(ctx.device), mesh)
    try:
        ns.fully_shard(model, mesh=mesh, dp_mesh_dims=ns.DataParallelMeshDims(**kwargs))
    except ValueError as exc:
        assert text in str(exc), f"{ctx.where()} ValueError {exc!r} does not say {text!r}"
    else:
        raise AssertionError(f"{ctx.where()} DataParallelMeshDims({kwargs}) raised nothing")


@check(
    area="training",
    requires={
        base.FSDP2_API,
        base.DTENSOR_PARAMS,
        base.FSDP2_DP_MESH_DIMS,
        base.RESHARD_AFTER_FORWARD,
    },
    world_sizes=(1, 2),
)
def dp_mesh_dims_int_reshard_refused(ctx):
    """P93: ``fully_shard(module, mesh=<("dp", "tp") mesh of shape (ws, 1)>,
    dp_mesh_dims=DataParallelMeshDims(shard="dp"), reshard_after_forward=1)``, the module's
    parameters being DTensors replicated on that mesh (``edges.OnMesh``, as ``dp_mesh_dims`` needs), raises
    NotImplementedError "reshard_after_forward as int is not yet supported with SPMD mesh
    (dp_mesh_dims)" and shards nothing: the module is no ``FSDPModule`` and its parameters keep
    their placements and values."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((ctx.world_size, 1), ("dp", "tp"))
    ctx.seed(0)
    module = OnMesh(Pair().to(ctx.device), mesh, None)
    before = {
        n: (p.placements, p.full_tensor().detach().clone()) for n, p in module.named_parameters()
    }
    expect_error(
        ctx,
        "fully_shard(dp_mesh_dims=..., reshard_after_forward=1)",
        NotImplementedError,
        r"reshard_after_forward as int is not yet supported with SPMD mesh \(dp_mesh_dims\)",
        lambda: ns.fully_shard(
            module,
            mesh=mesh,
            dp_mesh_dims=ns.DataParallelMeshDims(shard="dp"),
            reshard_after_forward=1,
        ),
    )
    assert not isinstance(module, ns.FSDPModule), (
        f"{ctx.where()} the refused module is an FSDPModule"
    )
    for name, param in module.named_parameters():
        placements, values = before[name]
        assert isinstance(param, DTensor) and param.placements == placements, (
            f"{ctx.where()} {name}: {type(param).__name__} "
            f"{getattr(param, 'placements', None)}, expected the DTensor's {placements}"
        )
        assert torch.equal(param.full_tensor().detach(), values), f"{ctx.where()} {name} changed"


DIMS = {base.FSDP2_API, base.DTENSOR_PARAMS, base.FSDP2_DP_MESH_DIMS}


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


SHARD_GROUP_SETTERS = {
    # name: (setter, its arguments, AssertionError text; "" for a bare AssertionError)
    "reshard-after-forward": ("set_reshard_after_forward", (True,), ""),
    "separate-reduce-scatter": (
        "set_separate_reduce_scatter_group",
        (),
        "Expected mesh_info to be FSDPMeshInfo",
    ),
    "pg-allocator": (
        "set_allocate_memory_from_process_group_for_comm",
        (True,),
        "Expected mesh_info to be FSDPMeshInfo",
    ),
}


@check(
    area="training",
    requires=REQUIRES,
    cases={n: {"name": n} for n in SHARD_GROUP_SETTERS},
    world_sizes=(1, 2),
)
def replicate_only_refuses_shard_setters(ctx, name):
    """P126: a unit sharded with ``DataParallelMeshDims(replicate="dp")`` alone (P69: nothing
    sharded, plain data parallelism on a ``("dp", "tp")`` mesh of shape ``(ws, 1)``) has no shard
    group, so the setters that act on one refuse with AssertionError when called on the unit
    ``inp``: ``set_reshard_after_forward(True)`` (bare), ``set_separate_reduce_scatter_group()`` and
    ``set_allocate_memory_from_process_group_for_comm(True)`` ("Expected mesh_info to be
    FSDPMeshInfo ..."), while ``set_allocate_memory_from_process_group_for_comm(False)`` is
    accepted. The refusal leaves training intact: a forward/backward on this rank's samples gives
    every parameter (``Replicate()``, the whole tensor locally) the unsharded model's gradient on
    the global batch, averaged over the ranks."""
    method, args, text = SHARD_GROUP_SETTERS[name]
    mesh = ctx.make_mesh((ctx.world_size, 1), ("dp", "tp"))
    oracle, model = dp_dims_pair(ctx, mesh, {"replicate": "dp"})
    if method == "set_allocate_memory_from_process_group_for_comm":
        model.inp.set_allocate_memory_from_process_group_for_comm(False)  # no group needed
    call = f"inp.{method}{args!r}"
    try:
        getattr(model.inp, method)(*args)
    except AssertionError as exc:
        assert text in str(exc), f"{ctx.where()} {call}: AssertionError {exc!r} lacks {text!r}"
    else:
        raise AssertionError(
            f"{ctx.where()} {call} on a replicate-only unit was accepted; expected AssertionError"
        )
    assert_dp_grads(ctx, model, oracle, 93, lambda full: full, f"after the refused {method}")
