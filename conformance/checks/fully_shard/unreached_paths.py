"""FSDP2 contracts on paths that no other case runs (P91-P97): refusals of the public API
(``copy.deepcopy``, ``register_fsdp_forward_method`` with a missing name, an int
``reshard_after_forward`` with ``dp_mesh_dims``, a stream for the all-reduce hook under native
HSDP), the deprecated ``set_reduce_scatter_divide_factor``, an all-gather-extension parameter under
CPU offload, and a module whose parameters are all ignored but which holds buffers.

[Note: ignored parameters and the buffers beside them]
``fully_shard(model, ignored_params=S)`` leaves the parameters in ``S`` alone: not sharded (plain
tensors, not DTensors), not moved to the mesh's device, their gradients not reduced. A module
whose own parameters are all in ``S`` (and whose children are all ignored too) is left out of
FSDP's management, unless it holds a buffer: such a module stays managed, so its buffers are moved
to the mesh's device like every other managed buffer (only the parameters are ignored). The model
is built on the CPU and sharded on ``ctx.device``; on a CPU-only run the two coincide and the
device half holds trivially. In training a ``BatchNorm1d`` whose parameters are ignored sees only
its rank's samples (its batch statistics, running statistics and gradients are those of the
unsharded model run on the rank's slice alone), while the sharded ``Linear`` before it gets the
gradient averaged over the ranks (the unsharded model run on each rank's slice in turn, the
per-slice losses averaged).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    B,
    assert_close,
    local_chunk,
    make_batch,
    named_unique,
    per_sample_loss,
    shard_dim,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard._subclasses import Single5
from conformance.checks.fully_shard.edges import OnMesh, Pair
from conformance.checks.fully_shard.extensions import train_through_hooks
from conformance.registry import check

HSDP_SHAPES = {2: (2, 1), 4: (2, 2)}  # (replicate, shard) per world size


def _pair(ctx):
    """``Sequential(Linear(4, 4), Tanh(), Linear(4, 2))`` and its sharded copy (both Linears and
    the root are units)."""
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model[0], model[2], model):
        ctx.impl.ns.fully_shard(unit, mesh=ctx.mesh)
    return model, oracle


def _assert_forward_matches(ctx, model, oracle, what):
    g = torch.Generator().manual_seed(91)
    x = torch.randn(B, 4, generator=g).to(ctx.device)
    with torch.no_grad():
        assert_close(ctx, f"{what}: forward output", model(x), oracle(x), FP32["param"])


@check(area="lifecycle", requires={base.FSDP2_API}, world_sizes=(1, 2))
def deepcopy_refused(ctx):
    """P91: ``copy.deepcopy`` of a ``fully_shard`` unit (the root, a nested unit, or a plain module
    holding one) raises AssertionError "FSDP does not support deepcopy. Please use state dict for
    serialization." rather than copying sharded state; the model still computes the unsharded
    model's output afterwards."""
    model, oracle = _pair(ctx)
    holder = nn.ModuleList([model[0]])
    for what, module in (("the root", model), ("model[0]", model[0]), ("a plain holder", holder)):
        expect_error(
            ctx,
            f"copy.deepcopy({what})",
            AssertionError,
            r"FSDP does not support deepcopy\. Please use state dict for serialization",
            lambda module=module: copy.deepcopy(module),
        )
    _assert_forward_matches(ctx, model, oracle, "after the refused deepcopies")


@check(area="states", requires={base.FSDP2_API, base.FSDP2_FORWARD_METHOD}, world_sizes=(1, 2))
def forward_method_missing_name(ctx):
    """P92: ``register_fsdp_forward_method(unit, name)`` for a name the unit lacks raises
    ValueError naming the unit's class and the name (``<class ...FSDPSequential'> does not have a
    method encode_all``) and registers nothing; on a module that is not an ``FSDPModule`` it is a
    no-op, even for a missing name. The model still computes the unsharded model's output."""
    ns = ctx.impl.ns
    model, oracle = _pair(ctx)
    expect_error(
        ctx,
        "register_fsdp_forward_method(model, 'encode_all')",
        ValueError,
        rf"{type(model).__name__}.*does not have a method encode_all",
        lambda: ns.register_fsdp_forward_method(model, "encode_all"),
    )
    assert not hasattr(model, "encode_all"), f"{ctx.where()} the refused name was registered"
    plain = nn.Linear(4, 4)
    try:
        ns.register_fsdp_forward_method(plain, "encode_all")
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} register_fsdp_forward_method on a plain nn.Linear raised "
            f"{type(exc).__name__}: {str(exc)[:300]}; it is a no-op for a non-FSDP module"
        ) from exc
    _assert_forward_matches(ctx, model, oracle, "after the refused registration")


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


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.HSDP, base.HSDP_ALL_REDUCE},
    world_sizes=(2, 4),
)
def all_reduce_hook_stream_hsdp_refused(ctx):
    """P94: on a (replicate, shard) mesh ((2, 1) at world size 2, (2, 2) at 4) the all-reduce hook
    runs in FSDP's own all-reduce stream, so ``unit.set_all_reduce_hook(hook, stream=s)`` with a
    stream ``s`` (``torch.get_device_module(device).Stream()``, also on CPU) raises ValueError
    "stream cannot be set when using native HSDP"."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh(HSDP_SHAPES[ctx.world_size], ("replicate", "shard"))
    ctx.seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
    ns.fully_shard(model, mesh=mesh)
    stream = torch.get_device_module(ctx.device).Stream()
    expect_error(
        ctx,
        "set_all_reduce_hook(hook, stream=s) under HSDP",
        ValueError,
        r"stream cannot be set when using native HSDP",
        lambda: model.set_all_reduce_hook(lambda reduced: None, stream=stream),
    )


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    world_sizes=(2, 4),
)
def reduce_scatter_divide_factor_alias(ctx):
    """P95: ``set_reduce_scatter_divide_factor(f)`` is the deprecated name of
    ``set_gradient_divide_factor(f)``: it warns (DeprecationWarning "Use
    `set_gradient_divide_factor` instead") and the reduced gradients are the SUM of the ranks'
    gradients divided by f (here f = 3.0, an MLP sharded at the root, losses summed), as after ``set_gradient_divide_factor(f)``.
    Reduced with ``set_force_sum_reduction_for_comms(True)`` (a SUM, then the divide), since a
    factor other than the shard size otherwise needs ``ReduceOp.PREMUL_SUM``, which gloo lacks
    (from world size 2, as ``force_sum_with_divide_factor``: at 1 upstream divides twice)."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=None)
    model.set_force_sum_reduction_for_comms(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(3.0)
    said = [f"{w.category.__name__}: {w.message}" for w in caught]
    assert any(
        issubclass(w.category, DeprecationWarning)
        and "set_gradient_divide_factor" in str(w.message)
        for w in caught
    ), f"{ctx.where()} no DeprecationWarning naming set_gradient_divide_factor: {said}"
    x, y = make_batch("mlp", ws, 0, ctx.device)
    mine = slice(rank * B, (rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).sum().backward()
    per_sample_loss("mlp", oracle(x), y).sum().backward()
    for (name, param), (_, ref) in zip(named_unique(model), named_unique(oracle)):
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient after backward"
        assert_close(
            ctx,
            f"gradient of {name} divided by 3.0",
            param.grad.to_local(),
            local_chunk(ref.grad / 3.0, shard_dim(param), ws, rank),
            FP32["grad"],
        )


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.TRAINING, base.CPU_OFFLOAD},
)
def train_step_through_hooks_offload(ctx):
    """P96: an all-gather-extension parameter (``Single5``, uneven dim 0) under
    ``offload_policy=CPUOffloadPolicy(pin_memory=False)`` trains as without offload:
    FSDP hands the pre hook the shard moved to the compute device, and each step's loss, the sharded
    gradient and the values after 3 SGD steps equal the unsharded model's."""
    train_through_hooks(
        ctx, Single5, True, offload_policy=ctx.impl.ns.CPUOffloadPolicy(pin_memory=False)
    )


class LinearNorm(nn.Module):
    """``Linear(4, 4)`` then ``BatchNorm1d(4)`` (running statistics as buffers)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))


@check(area="training", requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API})
def ignored_params_module_with_buffers(ctx):
    """P97: ``fully_shard(m, mesh, ignored_params=set(m.norm.parameters()))`` on
    ``LinearNorm`` built on the CPU (module Note): ``norm.weight``/``norm.bias`` stay plain tensors
    on the CPU with their values, ``lin``'s parameters are DTensors, and ``norm``'s buffers
    (``running_mean``, ``running_var``, ``num_batches_tracked``) are on the mesh's device, since
    ``norm`` holds buffers and so stays managed. After ``m.norm.to(device)`` a training forward
    gives the unsharded model's output on the rank's slice, ``lin``'s sharded gradient is the
    chunk of the gradient averaged over the ranks' slices, ``norm``'s gradients and running
    statistics are the rank's own (not reduced)."""
    ws, rank, device = ctx.world_size, ctx.rank, ctx.device
    ctx.seed(0)
    built = LinearNorm()
    model = copy.deepcopy(built)
    ignored = set(model.norm.parameters())
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, ignored_params=ignored)
    for name in ("weight", "bias"):
        param = getattr(model.norm, name)
        assert not isinstance(param, DTensor), f"{ctx.where()} ignored norm.{name} is a DTensor"
        assert param.device.type == "cpu", (
            f"{ctx.where()} ignored norm.{name} moved to {param.device}; ignored parameters stay"
        )
        assert torch.equal(param.detach(), getattr(built.norm, name).detach()), (
            f"{ctx.where()} ignored norm.{name} changed its values"
        )
    for name, param in model.lin.named_parameters():
        assert isinstance(param, DTensor), f"{ctx.where()} lin.{name} is not a DTensor"
    for name, buf in model.norm.named_buffers():
        assert buf.device.type == device.type, (
            f"{ctx.where()} norm.{name} is on {buf.device}, expected the mesh's device "
            f"{device.type}: a module holding buffers stays managed even with every parameter ignored"
        )
    model.norm.to(device)
    glob = copy.deepcopy(built).to(device)  # Linear's oracle: slices one by one, losses averaged
    own = copy.deepcopy(built).to(device)  # norm's oracle: this rank's slice alone
    g = torch.Generator().manual_seed(97)
    x = torch.randn(ws * 4, 4, generator=g).to(device)
    slices = [slice(r * 4, (r + 1) * 4) for r in range(ws)]
    out = model(x[slices[rank]])
    expected = own(x[slices[rank]])
    assert_close(ctx, "training forward output", out, expected, FP32["param"])
    out.square().mean().backward()
    expected.square().mean().backward()
    torch.stack([glob(x[s]).square().mean() for s in slices]).mean().backward()
    for name, param in model.lin.named_parameters():
        assert_close(
            ctx,
            f"lin.{name} sharded gradient (averaged over the ranks' slices)",
            param.grad.to_local(),
            chunk_of(glob.lin.get_parameter(name).grad, shard_dim(param), ws, rank),
            FP32["grad"],
        )
    for name, param in model.norm.named_parameters():
        assert param.grad is not None and not isinstance(param.grad, DTensor), (
            f"{ctx.where()} ignored norm.{name}: gradient {type(param.grad).__name__}, expected "
            "a plain tensor"
        )
        assert_close(
            ctx,
            f"ignored norm.{name} gradient (this rank's, not reduced)",
            param.grad,
            own.norm.get_parameter(name).grad,
            FP32["grad"],
        )
    for name, buf in model.norm.named_buffers():
        expected_buf = own.norm.get_buffer(name)
        if buf.is_floating_point():
            assert_close(ctx, f"norm.{name} after the forward", buf, expected_buf, FP32["param"])
        else:
            assert torch.equal(buf.cpu(), expected_buf.cpu()), f"{ctx.where()} norm.{name} differs"
