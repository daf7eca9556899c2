"""Area "training": FSDP2 layouts at the edges of the mesh rules (P56-P59).

[Note: flattened shard dims]
``DataParallelMeshDims(shard=("dp", "cp"))`` names several mesh dims to shard over: FSDP treats them
as one dim whose size is the product of theirs and whose index is the rank's row-major index over
them. The sharded parameter is a DTensor on a mesh with that one flattened dim in place of the
named ones (HSDP: preceded by the replicate dim, which leaves its own place), the other dims kept
in order, so ``("dp", "cp", "tp")`` gives a 2-D ``(dp*cp, tp)`` mesh and ``("rep", "dp", "cp")`` a
2-D ``(rep, dp*cp)`` one. On the shard dim the placement is ``Shard(0)``, or
``_StridedShard(0, split_factor=t)`` when a later (tensor-parallel) dim of size t already splits dim
0; replicate dims are ``Replicate()``; tensor-parallel dims keep their placement. The local tensor
is chunk ``index`` (over the flattened size, dim 0) of the tensor-parallel local tensor.

[Note: samples]
Ranks that differ only in a non-data-parallel (tp) coordinate are one replica and feed the same
samples; every distinct coordinate over the data-parallel dims (shard and replicate) is its own
replica, so the gradient is the unsharded model's averaged over those replicas and training on the
global batch is the oracle's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    make_optimizer,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

SPMD = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_DP_MESH_DIMS}
TP_DIM = {"inp.weight": 0, "inp.bias": 0, "out.weight": 1, "out.bias": None}


class Pair(nn.Module):
    """Linear(4, 8) -> tanh -> Linear(8, 4): even under a tensor-parallel split of 2."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class OnMesh(nn.Module):
    """``Pair`` computing on DTensors of ``mesh``: every parameter is ``Replicate()`` on every dim
    except ``tp`` (if named), where ``inp`` is column- and ``out`` row-parallel (``TP_DIM``); the
    input enters replicated and the output leaves gathered."""

    def __init__(self, pair: Pair, mesh, tp: str | None):
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        self.mesh = mesh
        self.inp, self.out = pair.inp, pair.out
        for fqn, param in list(pair.named_parameters()):
            placements = [Replicate()] * mesh.ndim
            if tp is not None and TP_DIM[fqn] is not None:
                placements[mesh.mesh_dim_names.index(tp)] = Shard(TP_DIM[fqn])
            module, name = fqn.split(".")
            dtensor = distribute_tensor(param.detach(), mesh, placements)
            setattr(getattr(self, module), name, nn.Parameter(dtensor))

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return self.out(torch.tanh(self.inp(x))).full_tensor()


def dp_dims_pair(ctx, mesh, dims: dict):
    """(oracle ``Pair`` (seed 0), the same ``Pair`` on ``mesh`` with ``inp``, ``out`` and the root
    each a ``fully_shard`` unit under ``DataParallelMeshDims(**dims)``)."""
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = OnMesh(copy.deepcopy(oracle), mesh, None)
    for unit in (model.inp, model.out, model):
        ctx.impl.ns.fully_shard(
            unit, mesh=mesh, dp_mesh_dims=ctx.impl.ns.DataParallelMeshDims(**dims)
        )
    return oracle, model


def assert_dp_grads(ctx, model, oracle, seed: int, part, what: str) -> None:
    """A forward/backward of ``model`` on this rank's ``B`` samples of a global batch (drawn from
    ``seed``) and of ``oracle`` on all of it: every gradient is a DTensor whose local tensor is
    ``part`` of the oracle's (the mean over the ranks)."""
    from torch.distributed.tensor import DTensor

    ws, rank = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), f"{ctx.where()} {fqn}.grad is {param.grad!r}"
        assert_close(
            ctx,
            f"{fqn} gradient {what}",
            param.grad.to_local(),
            part(oracle.get_parameter(fqn).grad),
            FP32["grad"],
        )


def _index(coords, sizes, dims):
    """Row-major index of ``coords`` over ``dims`` (and the product of their sizes)."""
    index, size = 0, 1
    for d in dims:
        index, size = index * sizes[d] + coords[d], size * sizes[d]
    return index, size


FLAT_CASES = {
    # name: (mesh dim names, mesh shape, DataParallelMeshDims kwargs, tp dim)
    "flat": (("dp", "cp"), (2, 2), {"shard": ("dp", "cp")}, None),
    "flat-hsdp": (
        ("rep", "dp", "cp"),
        (2, 1, 2),
        {"shard": ("dp", "cp"), "replicate": "rep"},
        None,
    ),
    "flat-tp": (("dp", "cp", "tp"), (1, 2, 2), {"shard": ("dp", "cp")}, "tp"),
}


@check(area="training", requires=SPMD, cases={n: {"name": n} for n in FLAT_CASES}, world_sizes=(4,))
def dp_mesh_dims_flattened(ctx, name):
    """P56: ``fully_shard(unit, mesh=spmd_mesh, dp_mesh_dims=...)`` with a tuple of shard dims (and
    with a tensor-parallel dim) lays each parameter out by the module Note (mesh sizes,
    placements, local chunk); an SGD step gives sharded gradients equal to the oracle's chunks of
    the gradient averaged over the data-parallel replicas and parameters equal to its."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ns = ctx.impl.ns
    names, shape, dims, tp = FLAT_CASES[name]
    mesh = ctx.make_mesh(shape, names)
    sizes = dict(zip(names, shape))
    coords = dict(zip(names, mesh.get_coordinate()))
    shard_names = (dims["shard"],) if isinstance(dims["shard"], str) else dims["shard"]
    rep_names = (dims["replicate"],) if "replicate" in dims else ()
    index, parts = _index(coords, sizes, shard_names)
    replica, replicas = _index(coords, sizes, rep_names + shard_names)
    tp_size = sizes[tp] if tp else 1

    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = OnMesh(copy.deepcopy(oracle), mesh, tp)
    for unit in (model.inp, model.out, model):
        ns.fully_shard(unit, mesh=mesh, dp_mesh_dims=ns.DataParallelMeshDims(**dims))

    def expected_layout(fqn):
        """(mesh sizes, placements) of ``fqn``'s sharded DTensor by the module Note."""
        strided = tp is not None and TP_DIM[fqn] == 0 and tp_size > 1
        shard = _StridedShard(0, split_factor=tp_size) if strided else Shard(0)
        out_sizes, out = [], []
        if rep_names:
            out_sizes.append(sizes[rep_names[0]])
            out.append(Replicate())
        out_sizes.append(parts)
        out.append(shard)
        if tp:
            out_sizes.append(tp_size)
            out.append(Replicate() if TP_DIM[fqn] is None else Shard(TP_DIM[fqn]))
        return tuple(out_sizes), tuple(out)

    def expected_local(fqn, full):
        if tp and TP_DIM[fqn] is not None:
            full = chunk_of(full, TP_DIM[fqn], tp_size, coords[tp])
        return chunk_of(full, 0, parts, index)

    for fqn, param in model.named_parameters():
        want_sizes, want = expected_layout(fqn)
        got_sizes = tuple(param.device_mesh.shape) if isinstance(param, DTensor) else None
        assert got_sizes == want_sizes and tuple(param.placements) == want, (
            f"{ctx.where()} {fqn}: {type(param).__name__} on mesh {got_sizes} "
            f"{getattr(param, 'placements', None)}, expected mesh {want_sizes} {want}"
        )
        assert_close(
            ctx,
            f"{fqn} local shard (chunk {index} of {parts})",
            param.to_local(),
            expected_local(fqn, oracle.get_parameter(fqn)),
            FP32["param"],
        )
    mine = slice(replica * B, (replica + 1) * B)
    g = torch.Generator().manual_seed(90)
    x = torch.randn(replicas * B, 4, generator=g).to(ctx.device)
    model(x[mine]).square().mean().backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} sharded gradient (averaged over {replicas} replicas)",
            param.grad.to_local(),
            expected_local(fqn, oracle.get_parameter(fqn).grad),
            FP32["grad"],
        )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    step_and_compare(ctx, model, oracle, opts, 0)


REJECT_CASES = {
    # name: (mesh names, parameter placements per dim ("R", "S0") or None for plain tensors,
    #        DataParallelMeshDims kwargs, words of the ValueError)
    "plain-params": (("dp", "tp"), None, {"shard": "dp"}, "must be DTensors"),
    "sharded-on-shard-dim": (
        ("dp", "tp"),
        ("S0", "R"),
        {"shard": "dp"},
        "Expected Replicate() on DP shard dim 'dp'",
    ),
    "sharded-on-replicate-dim": (
        ("rep", "dp"),
        ("S0", "R"),
        {"shard": "dp", "replicate": "rep"},
        "Expected Replicate() on DP replicate dim 'rep'",
    ),
    "other-mesh": (("dp", "tp"), ("R", "R"), {"shard": "dp"}, "same mesh"),
}


@check(
    area="training",
    requires={base.FSDP2_API, base.FSDP2_DP_MESH_DIMS},
    cases={n: {"name": n} for n in REJECT_CASES},
    world_sizes=(2,),
)
def dp_mesh_dims_rejects_params(ctx, name):
    """P57: with ``dp_mesh_dims`` every managed parameter must be a DTensor on the very mesh passed
    to ``fully_shard``, ``Replicate()`` on each named data-parallel dim; otherwise ``fully_shard``
    raises ValueError: a plain tensor ("... must be DTensors ..."), ``Shard(0)`` on the shard dim
    ("Expected Replicate() on DP shard dim '<name>' ..."), on the replicate dim ("Expected
    Replicate() on DP replicate dim '<name>' ..."), a DTensor on another mesh object of the same
    shape ("... the same mesh passed to fully_shard ...")."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names, placements, dims, words = REJECT_CASES[name]
    mesh = ctx.make_mesh((2, 1), names)
    # another mesh object: the same shape, other dim names that still include the named ones
    param_mesh = ctx.make_mesh((2, 1), (names[0], "other")) if name == "other-mesh" else mesh
    ctx.seed(0)
    module = nn.Linear(4, 4).to(ctx.device)
    if placements is not None:
        kinds = {"R": Replicate(), "S0": Shard(0)}
        for pname, param in list(module.named_parameters()):
            dtensor = distribute_tensor(param.detach(), param_mesh, [kinds[k] for k in placements])
            setattr(module, pname, nn.Parameter(dtensor))
    ns = ctx.impl.ns
    try:
        ns.fully_shard(module, mesh=mesh, dp_mesh_dims=ns.DataParallelMeshDims(**dims))
    except ValueError as exc:
        assert words in str(exc), f"{ctx.where()} ValueError {exc!r} does not say {words!r}"
    else:
        raise AssertionError(f"{ctx.where()} fully_shard accepted the {name} parameters")


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    world_sizes=(1, 2),
)
def default_mesh(ctx):
    """P58: ``fully_shard(module)`` without ``mesh=`` shards over a 1-D mesh of every rank of the
    default group (size ws, ranks 0..ws-1 in order) on the run's device type: each parameter is
    ``Shard(0)`` with local chunk ``rank`` of ws, and an SGD step gives the oracle's sharded
    gradients and parameters."""
    from torch.distributed.tensor import DTensor, Shard

    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = ctx.impl.ns.fully_shard(copy.deepcopy(oracle))
    for fqn, param in model.named_parameters():
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        got = (
            None
            if mesh is None
            else (mesh.device_type, mesh.mesh.tolist(), tuple(param.placements))
        )
        want = (ctx.device.type, list(range(ws)), (Shard(0),))
        assert got == want, f"{ctx.where()} {fqn}: (device type, mesh ranks, placements) {got}"
        assert_close(
            ctx,
            f"{fqn} local shard (chunk {rank} of {ws})",
            param.to_local(),
            chunk_of(oracle.get_parameter(fqn), 0, ws, rank),
            FP32["param"],
        )
    g = torch.Generator().manual_seed(95)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} sharded gradient",
            param.grad.to_local(),
            chunk_of(oracle.get_parameter(fqn).grad, 0, ws, rank),
            FP32["grad"],
        )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    step_and_compare(ctx, model, oracle, opts, 0)


@check(
    area="tensor_parallel",
    requires={base.TRAINING, base.TENSOR_PARALLEL, base.HSDP, base.FSDP2_API},
    world_sizes=(4,),
)
def hsdp_over_tensor_parallel(ctx):
    """P59: ``fully_shard(unit, mesh=mesh3["rep", "dp"])`` over parameters made tensor parallel on
    ``mesh3["tp"]`` of a ("rep", "dp", "tp") = (1, 2, 2) mesh gives each parameter a DTensor on the
    3-D mesh with placements ``(Replicate(), dp placement, tp placement)`` (the dp placement
    ``_StridedShard(0, split_factor=2)`` where TP split dim 0, else ``Shard(0)``, as P15), its
    local tensor the dp chunk of the TP-local tensor; an SGD step gives sharded gradients equal to
    the oracle's pieces of the gradient averaged over the dp (and rep) replicas, and parameters
    equal to its."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    names, shape = ("rep", "dp", "tp"), (1, 2, 2)
    mesh = ctx.make_mesh(shape, names)
    coords = dict(zip(names, mesh.get_coordinate()))
    replica, replicas = _index(coords, dict(zip(names, shape)), ("rep", "dp"))
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = copy.deepcopy(oracle)
    parallelize_module(model, mesh["tp"], {"inp": ColwiseParallel(), "out": RowwiseParallel()})
    for unit in (model.inp, model.out, model):
        ctx.impl.ns.fully_shard(unit, mesh=mesh["rep", "dp"])

    def expected_local(fqn, full):
        if TP_DIM[fqn] is not None:
            full = chunk_of(full, TP_DIM[fqn], 2, coords["tp"])
        return chunk_of(full, 0, 2, coords["dp"])

    for fqn, param in model.named_parameters():
        tp_dim = TP_DIM[fqn]
        want = (
            Replicate(),
            _StridedShard(0, split_factor=2) if tp_dim == 0 else Shard(0),
            Replicate() if tp_dim is None else Shard(tp_dim),
        )
        got = tuple(param.placements) if isinstance(param, DTensor) else None
        got_shape = tuple(param.device_mesh.shape) if isinstance(param, DTensor) else None
        assert got == want and got_shape == shape, (
            f"{ctx.where()} {fqn}: {type(param).__name__} {got} on mesh {got_shape}, "
            f"expected {want} on {shape}"
        )
        assert_close(
            ctx,
            f"{fqn} local shard",
            param.to_local(),
            expected_local(fqn, oracle.get_parameter(fqn)),
            FP32["param"],
        )
    g = torch.Generator().manual_seed(97)
    x = torch.randn(replicas * B, 4, generator=g).to(ctx.device)
    model(x[replica * B : (replica + 1) * B]).square().mean().backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} sharded gradient",
            param.grad.to_local(),
            expected_local(fqn, oracle.get_parameter(fqn).grad),
            FP32["grad"],
        )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    step_and_compare(ctx, model, oracle, opts, 0)


@check(area="training", requires={base.FSDP2_API}, world_sizes=(1,))
def container_slice(ctx):
    """P61: slicing a ``fully_shard``-ed ``nn.Sequential`` (``model[0:2]``, which builds
    ``type(model)(...)``) gives a plain, initialised ``nn.Sequential`` (not an ``FSDPModule``)
    holding the same child modules, and leaves the model an ``FSDPModule`` of its three children."""
    ns = ctx.impl.ns
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))).to(ctx.device)
    children = list(model)
    ns.fully_shard(model, mesh=ctx.make_mesh((ctx.world_size,)))
    part = model[0:2]
    assert type(part) is nn.Sequential and not isinstance(part, ns.FSDPModule), (
        f"{ctx.where()} model[0:2] is a {type(part).__name__}, expected a plain Sequential"
    )
    got = [id(m) for m in part]
    assert got == [id(m) for m in children[:2]], (
        f"{ctx.where()} model[0:2] holds {list(part)}, expected the model's first two children"
    )
    assert isinstance(model, ns.FSDPModule) and len(model) == 3, (
        f"{ctx.where()} after slicing the model is a {type(model).__name__} of {len(model)}"
    )


@check(
    area="training",
    requires={base.TRAINING, base.FSDP2_API, base.FSDP2_FUNCTORCH},
    world_sizes=(1, 2),
)
def forward_mode_jvp(ctx):
    """P62: ``torch.func.jvp`` through a ``fully_shard`` model (units ``inp``, ``out`` and the
    root) gives the unsharded model's output and its directional derivative along ``v``, and a
    backward from a loss on that output gives the oracle's sharded gradients."""
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,))
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model.inp, model.out, model):
        ctx.impl.ns.fully_shard(unit, mesh=mesh)
    g = torch.Generator().manual_seed(96)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    v = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    mine = slice(rank * B, (rank + 1) * B)
    out, tangent = torch.func.jvp(model, (x[mine],), (v[mine],))
    with torch.no_grad():
        want_out, want_tangent = torch.func.jvp(oracle, (x[mine],), (v[mine],))
    assert_close(ctx, "jvp primal output", out, want_out, FP32["param"])
    assert_close(ctx, "jvp tangent", tangent, want_tangent, FP32["param"])
    out.square().mean().backward()  # through the jvp's primal output
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} sharded gradient of a loss on the jvp's primal output",
            param.grad.to_local(),
            chunk_of(oracle.get_parameter(fqn).grad, 0, ws, rank),
            FP32["grad"],
        )
