"""Area "training": edges of ``fully_shard``'s set-up (P68-P73, P81), and the parameter swaps
through a module's own ``__setattr__`` (P102).

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
* P81: ``disable_fsdp_module_new_init()`` switches off the re-initialisation that an FSDP class's
  ``__new__`` gives a module constructed from it.
* P102: FSDP swaps a module's sharded and unsharded parameters through the module's own
  ``__setattr__`` where its class overrides it.

[Note: the FSDP class's constructor]
``fully_shard`` swaps a module's class for ``FSDP<Class>`` (``FSDPModule`` first in its MRO);
calling that class (as a container does when it indexes or slices itself: ``type(self)(...)``)
builds an instance of the *original* class and, as ``__new__`` returns an instance of another
class, Python would skip ``__init__``: so FSDP's ``__new__`` runs the original ``__init__`` itself.
Inside ``with disable_fsdp_module_new_init():`` (of ``<ns>._fully_shard._fully_shard``) it does not:
the object comes back bare (an empty ``__dict__``), as a loader that fills the attributes itself
wants. Leaving the block, by its end or by an exception, restores the previous setting (nested
blocks stay disabled until the outermost ends).
"""

from __future__ import annotations

import copy
import inspect
import pickle

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    assert_sharded_grad,
    make_optimizer,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.edges import OnMesh, Pair, assert_dp_grads, dp_dims_pair
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

    names, dims = MESH_DIMS_CASES[name]
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,) + (1,) * (len(names) - 1), names)
    sharded = "shard" in dims
    want = (Shard(0),) if sharded else (Replicate(),)

    def part(full):
        return chunk_of(full, 0, ws, rank) if sharded else full

    oracle, model = dp_dims_pair(ctx, mesh, dims)
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
    assert_dp_grads(ctx, model, oracle, 91, part, f"(averaged over {ws} ranks)")
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


@check(area="training", requires={base.FSDP2_API, base.FSDP2_NEW_INIT_SWITCH}, world_sizes=(1,))
def new_init_switch(ctx):
    """P81: for ``m = nn.Linear(4, 4)`` after ``fully_shard(m)``, ``type(m)(3, 5)`` is a plain
    ``nn.Linear`` with a weight of shape (5, 3); inside ``with disable_fsdp_module_new_init():`` (of
    ``<ns>._fully_shard._fully_shard``) it is an ``nn.Linear`` with an empty ``__dict__``, also in a
    nested block after the inner one ends; after the block, and after an exception raised inside a
    block, it is initialised again."""
    ns = ctx.impl.ns
    switch = ns_module(ctx, "_fully_shard._fully_shard").disable_fsdp_module_new_init
    model = nn.Linear(4, 4).to(ctx.device)
    ns.fully_shard(model, mesh=ctx.make_mesh((ctx.world_size,)))
    cls = type(model)
    assert cls is not nn.Linear, f"{ctx.where()} setup: fully_shard kept the class nn.Linear"

    def assert_initialised(when):
        made = cls(3, 5)
        assert type(made) is nn.Linear, f"{ctx.where()} {when}: {cls.__name__}(3, 5) is {made!r}"
        assert tuple(made.weight.shape) == (5, 3), (
            f"{ctx.where()} {when}: {cls.__name__}(3, 5).weight has shape "
            f"{tuple(made.weight.shape)}, expected (5, 3)"
        )

    def assert_bare(when):
        made = cls(3, 5)
        assert type(made) is nn.Linear and not vars(made), (
            f"{ctx.where()} {when}: {cls.__name__}(3, 5) is a {type(made).__name__} with "
            f"attributes {sorted(vars(made))}, expected an uninitialised nn.Linear"
        )

    assert_initialised("before the switch")
    with switch():
        assert_bare("inside disable_fsdp_module_new_init()")
        with switch():
            assert_bare("inside a nested block")
        assert_bare("after the nested block ended, inside the outer one")
    assert_initialised("after the block")
    try:
        with switch():
            raise KeyError("raised inside the block")
    except KeyError:
        pass
    assert_initialised("after a block left by an exception")


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
