"""Area "training": edges of ``fully_shard``'s set-up (P68-P73).

* P68: the public FSDP2 names a namespace exports report that namespace as their ``__module__``
  (and ``inspect.getmodule`` finds it), whatever private module defines them.
* P69: ``DataParallelMeshDims(replicate="dp")`` with no shard dim is plain data parallelism (DDP)
  over the named dim: every parameter stays a whole ``Replicate()`` DTensor on that dim, every
  rank feeds its own samples and the gradient is the average over the ranks, so one SGD step
  equals the unsharded model's on the global batch.
* P70: three shard dims ``DataParallelMeshDims(shard=("dp", "cp", "ep"))`` flatten into one shard
  dim (P56) however many are named: the parameter is ``(Shard(0),)`` on a 1-D mesh of their
  product.
* P71: FSDP's parameter swaps fire no global parameter-registration hook.
* P72: ``dp_mesh_dims`` with parameters on a mesh without dim names raises AssertionError.
* P73: ``set_reduce_scatter_max_input_buffers`` recurses over FSDP modules only.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    make_optimizer,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.edges import OnMesh, Pair
from conformance.registry import check

PUBLIC_NAMES = (
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "share_comm_ctx",
    "register_fsdp_forward_method",
    "DataParallelMeshDims",
)


@check(area="training", requires={base.FSDP2_API, base.FSDP2_PUBLIC_MODULE}, world_sizes=(1,))
def public_names_module(ctx):
    """P68: every public FSDP2 name the namespace exports (``fully_shard`` first) has
    ``__module__ == ns.__name__``, ``inspect.getmodule`` gives the namespace, and pickling it by
    reference gives the same object back."""
    ns = ctx.impl.ns
    found = [name for name in PUBLIC_NAMES if hasattr(ns, name)]
    assert "fully_shard" in found, f"{ctx.where()} {ns.__name__} exports no fully_shard"
    for name in found:
        obj = getattr(ns, name)
        assert obj.__module__ == ns.__name__, (
            f"{ctx.where()} {ns.__name__}.{name}.__module__ is {obj.__module__!r}, "
            f"expected the public namespace {ns.__name__!r}"
        )
        assert inspect.getmodule(obj) is ns, (
            f"{ctx.where()} inspect.getmodule({ns.__name__}.{name}) is {inspect.getmodule(obj)}"
        )
        assert pickle.loads(pickle.dumps(obj)) is obj, (
            f"{ctx.where()} {ns.__name__}.{name} does not pickle by reference to itself"
        )


MESH_DIMS_CASES = {
    # name: (mesh dim names, DataParallelMeshDims kwargs); the first dim has every rank
    "replicate-only": (("dp",), {"replicate": "dp"}),
    "three-shard-dims": (("dp", "cp", "ep"), {"shard": ("dp", "cp", "ep")}),
}


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_DP_MESH_DIMS},
    cases={n: {"name": n} for n in MESH_DIMS_CASES},
    world_sizes=(1, 2),
)
def dp_mesh_dims_layouts(ctx, name):
    """P69 (``replicate-only``: ``DataParallelMeshDims(replicate="dp")`` on a ``("dp",)`` mesh of
    all ranks), P70 (``three-shard-dims``: ``shard=("dp", "cp", "ep")`` on a ``(ws, 1, 1)``
    mesh): after ``fully_shard(unit, mesh=mesh, dp_mesh_dims=...)`` every parameter is a DTensor
    on a 1-D mesh of ``ws`` ranks, ``(Replicate(),)`` holding the whole tensor (P69) or
    ``(Shard(0),)`` holding chunk ``rank`` of ``ws`` (P70); after a forward/backward on this
    rank's samples each gradient is the matching part of the unsharded model's on the global
    batch (averaged over the ranks), and an SGD step gives its parameters."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ns = ctx.impl.ns
    names, dims = MESH_DIMS_CASES[name]
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,) + (1,) * (len(names) - 1), names)
    sharded = "shard" in dims
    want = (Shard(0),) if sharded else (Replicate(),)

    def part(full):
        return chunk_of(full, 0, ws, rank) if sharded else full

    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = OnMesh(copy.deepcopy(oracle), mesh, None)
    for unit in (model.inp, model.out, model):
        ns.fully_shard(unit, mesh=mesh, dp_mesh_dims=ns.DataParallelMeshDims(**dims))
    for fqn, param in model.named_parameters():
        sizes = tuple(param.device_mesh.shape) if isinstance(param, DTensor) else None
        assert sizes == (ws,) and tuple(param.placements) == want, (
            f"{ctx.where()} {fqn}: {type(param).__name__} on mesh {sizes} "
            f"{getattr(param, 'placements', None)}, expected a DTensor on mesh ({ws},) {want}"
        )
        assert_close(
            ctx,
            f"{fqn} local tensor",
            param.to_local(),
            part(oracle.get_parameter(fqn)),
            FP32["param"],
        )
    g = torch.Generator().manual_seed(91)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), f"{ctx.where()} {fqn}.grad is {param.grad!r}"
        assert_close(
            ctx,
            f"{fqn} gradient (averaged over {ws} ranks)",
            param.grad.to_local(),
            part(oracle.get_parameter(fqn).grad),
            FP32["grad"],
        )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    step_and_compare(ctx, model, oracle, opts, 0)


@check(
    area="training",
    requires={base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_DP_MESH_DIMS},
    world_sizes=(1,),
)
def dp_mesh_dims_unnamed_param_mesh(ctx):
    """P72: with ``dp_mesh_dims`` the parameters' DTensor mesh must have dim names: parameters
    on a mesh without ``mesh_dim_names`` make ``fully_shard(model, mesh=<named mesh>,
    dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` raise AssertionError naming
    ``mesh_dim_names``."""
    ns = ctx.impl.ns
    ws = ctx.world_size
    named = ctx.make_mesh((ws,), ("dp",))
    unnamed = ctx.make_mesh((ws,), None)
    ctx.seed(0)
    model = OnMesh(Pair().to(ctx.device), unnamed, None)
    try:
        ns.fully_shard(model, mesh=named, dp_mesh_dims=ns.DataParallelMeshDims(shard="dp"))
    except AssertionError as exc:
        assert "mesh_dim_names must not be None" in str(exc), (
            f"{ctx.where()} AssertionError {exc!r} does not name mesh_dim_names"
        )
    else:
        raise AssertionError(f"{ctx.where()} parameters on an unnamed mesh raised nothing")


@check(area="training", requires={base.TRAINING, base.FSDP2_API}, world_sizes=(1, 2))
def swaps_fire_no_registration_hooks(ctx):
    """P71: FSDP's swaps between sharded and unsharded parameters are not registrations: a global
    ``register_module_parameter_registration_hook`` registered after ``fully_shard`` (on a
    ``Linear`` and its ``Sequential`` root) is called for none of them during a forward and
    backward, and the step's gradients are the unsharded model's chunks."""
    from torch import nn
    from torch.nn.modules.module import register_module_parameter_registration_hook

    ns = ctx.impl.ns
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4)).to(ctx.device)
    model = copy.deepcopy(oracle)
    mesh = ctx.make_mesh((ws,))
    ns.fully_shard(model[0], mesh=mesh)
    ns.fully_shard(model, mesh=mesh)
    calls = []
    handle = register_module_parameter_registration_hook(
        lambda module, name, param: calls.append((type(module).__name__, name))
    )
    try:
        g = torch.Generator().manual_seed(92)
        x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
        model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    finally:
        handle.remove()
    assert not calls, f"{ctx.where()} parameter registration hooks fired for {calls}"
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} sharded gradient",
            param.grad.to_local(),
            chunk_of(oracle.get_parameter(fqn).grad, 0, ws, rank),
            FP32["grad"],
        )


@check(area="training", requires={base.TRAINING, base.FSDP2_API}, world_sizes=(1, 2))
def max_input_buffers_plain_children(ctx):
    """P73: ``set_reduce_scatter_max_input_buffers(2)`` (recursive by default) on a root
    ``fully_shard``-ed alone, whose children are plain modules, sets the root's groups and
    passes over the plain children; a forward/backward and SGD step afterwards equal the
    unsharded model's (the knob changes no value)."""
    from torch import nn

    ns = ctx.impl.ns
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(ctx.device)
    model = copy.deepcopy(oracle)
    ns.fully_shard(model, mesh=ctx.make_mesh((ws,)))
    model.set_reduce_scatter_max_input_buffers(2)
    g = torch.Generator().manual_seed(93)
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
