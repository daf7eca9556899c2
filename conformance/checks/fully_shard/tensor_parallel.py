"""Area "tensor_parallel": FSDP on the dp dim of a 2-D (dp, tp) mesh over tensor-parallel DTensor
parameters (P15), at world size 4 as a 2 x 2 mesh (the sequence-parallel check also at 2, as 1 x 2), with
``param_dtype=bf16`` (P128), and the 3-D model-parallel meshes it refuses (P127).

[Note: the layout rule]
``parallelize_module`` (``in_proj``: ``ColwiseParallel``, ``out_proj``: ``RowwiseParallel``) leaves
each parameter a DTensor on the tp mesh: ``in_proj.weight``/``bias`` ``Shard(0)``,
``out_proj.weight`` ``Shard(1)``, ``out_proj.bias`` ``Replicate()``. ``fully_shard(mesh=dp)`` then
shards each *TP-local* tensor on dim 0 over dp, so the rank at (dp i, tp j) holds chunk i (over dp,
dim 0) of chunk j (over tp, on the TP dim) of the original. The parameter is a DTensor on the 2-D
mesh with placements (dp placement, tp placement): ``_StridedShard(0, split_factor=2)`` for dp
where TP already split dim 0, else ``Shard(0)``; ``full_tensor()`` is the original.

[Note: the oracle]
Ranks of one tp group see the same samples (those of their dp index); the oracle is the plain model
trained in one process on the whole batch, so FSDP's average over dp must give its gradient.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

DP = TP = 2
B = 2  # samples per dp rank per step
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)
# Hidden sizes: even keeps every dp chunk the same size; uneven leaves the last dp rank's TP-local
# in_proj rows one short (7 rows over dp 2) and out_proj's 6 rows even.
CASES = {"even": {"dim": 8, "hidden": 12}, "uneven": {"dim": 6, "hidden": 14}}


class TPMLP(nn.Module):
    """``in_proj`` (ColwiseParallel) -> relu -> ``out_proj`` (RowwiseParallel)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


def _placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "in_proj.weight": (_StridedShard(0, split_factor=TP), Shard(0)),
        "in_proj.bias": (_StridedShard(0, split_factor=TP), Shard(0)),
        "out_proj.weight": (Shard(0), Shard(1)),
        "out_proj.bias": (Shard(0), Replicate()),
    }


TP_DIM = {"in_proj.weight": 0, "in_proj.bias": 0, "out_proj.weight": 1, "out_proj.bias": None}


def _build(ctx, dim, hidden, seed=0):
    """(sharded model, plain oracle with the same initial values, 2-D mesh)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = ctx.make_mesh((DP, TP), ("dp", "tp"))
    ctx.seed(seed)
    model = TPMLP(dim, hidden).to(ctx.device)
    oracle = copy.deepcopy(model)
    parallelize_module(
        model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    ctx.impl.ns.fully_shard(model, mesh=mesh["dp"])
    return model, oracle, mesh


def _expected_local(ctx, name, full):
    """This rank's piece of ``full`` by the layout rule (dp chunk of the tp chunk)."""
    dp_rank, tp_rank = divmod(ctx.rank, TP)
    tp_local = full if TP_DIM[name] is None else chunk_of(full, TP_DIM[name], TP, tp_rank)
    return chunk_of(tp_local, 0, DP, dp_rank)


def _check_values(ctx, what, params, oracle):
    """Every DTensor in ``params`` is on the 2-D mesh with the rule's placements, holds this rank's
    piece of the oracle's tensor and gathers to it."""
    from torch.distributed.tensor import DTensor

    for name, placements in _placements().items():
        param, full = params[name], oracle.get_parameter(name).detach()
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, (
            f"{ctx.where()} {what} {name}: expected a DTensor on the 2-D (dp, tp) mesh, got "
            f"{type(param).__name__} on {getattr(param, 'device_mesh', None)}"
        )
        assert tuple(param.placements) == placements, (
            f"{ctx.where()} {what} {name}: placements {param.placements}, expected {placements}"
        )
        assert tuple(param.shape) == tuple(full.shape), (
            f"{ctx.where()} {what} {name}: global shape {tuple(param.shape)}, expected "
            f"{tuple(full.shape)}"
        )
        assert_close(
            ctx,
            f"{what} {name} local shard (dp chunk of the tp chunk)",
            param.to_local(),
            _expected_local(ctx, name, full),
            TOL,
        )
        assert_close(ctx, f"{what} {name} full_tensor()", param.full_tensor(), full, TOL)


def _batch(ctx, step, dim):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(DP * B, dim, generator=g), torch.randn(DP * B, dim, generator=g)
    mine = slice(ctx.rank // TP * B, (ctx.rank // TP + 1) * B)  # this rank's dp index's samples
    return x.to(ctx.device), y.to(ctx.device), mine


def _train(ctx, model, oracle, dim, steps=STEPS):
    """SGD with momentum on both; compares losses and the gathered gradients every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y, mine = _batch(ctx, step, dim)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        oloss = F.mse_loss(oracle(x), y)
        oloss.backward()
        assert_close(
            ctx, f"step {step} loss", loss, F.mse_loss(oracle(x[mine]).detach(), y[mine]), TOL
        )
        _compare_grads_then_step(ctx, model, oracle, (opt, oopt), step)


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.FSDP2_API},
    world_sizes=(4,),
    cases=CASES,
)
def layout(ctx, dim, hidden):
    """FSDP over TP parameters: (dp, tp) placements, dp chunk of the TP-local tensor (P15).

    Each parameter is a DTensor on the 2-D mesh with the Note's placements (``_StridedShard`` where
    TP split dim 0), its local shard is the dp chunk of the TP-local tensor, and ``full_tensor()``
    equals the original."""
    model, oracle, _ = _build(ctx, dim, hidden)
    _check_values(ctx, "after fully_shard", dict(model.named_parameters()), oracle)


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.TRAINING, base.FSDP2_API},
    world_sizes=(4,),
    cases=CASES,
)
def train_parity(ctx, dim, hidden):
    """FSDP over TP trains like the plain model on the whole batch (P15, P6).

    Equal losses, gathered gradients (the dp average) and parameters after several SGD steps;
    the layout stays that of the Note."""
    model, oracle, _ = _build(ctx, dim, hidden)
    _train(ctx, model, oracle, dim)
    _check_values(ctx, f"after {STEPS} steps", dict(model.named_parameters()), oracle)


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.TRAINING, base.FSDP2_API},
    world_sizes=(4,),
    cases=CASES,
)
def state_dict_round_trip(ctx, dim, hidden):
    """An FSDP+TP state dict holds the 2-D DTensors and round-trips (P15, P8).

    ``state_dict()`` of a trained model holds DTensors on the 2-D mesh with the Note's placements
    and the oracle's values; loading it into a fresh FSDP+TP model reproduces values and forward."""
    model, oracle, _ = _build(ctx, dim, hidden)
    _train(ctx, model, oracle, dim, steps=1)
    state_dict = model.state_dict()
    _check_values(ctx, "state dict", state_dict, oracle)
    fresh, _, _ = _build(ctx, dim, hidden, seed=1)
    fresh.load_state_dict(state_dict)
    _check_values(ctx, "after load_state_dict", dict(fresh.named_parameters()), oracle)
    x, _, mine = _batch(ctx, STEPS, dim)
    with torch.no_grad():
        assert_close(ctx, "forward of the loaded model", fresh(x[mine]), oracle(x[mine]), TOL)


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.RESHARD_AFTER_FORWARD, base.FSDP2_API},
    world_sizes=(4,),
)
def no_smaller_mesh_reshard(ctx):
    """Resharding TP parameters after forward to a smaller mesh raises NotImplementedError (P3).

    With dp = 2 an int ``reshard_after_forward`` can only be 1 or 2 (no smaller group), so the
    check reshards onto 2 of 4 ranks of a (dp=4, tp=1) mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = ctx.make_mesh((4, 1), ("dp", "tp"))
    ctx.seed(0)
    model = TPMLP(8, 8).to(ctx.device)
    parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel()})
    ctx.impl.ns.fully_shard(model.in_proj, mesh=mesh["dp"], reshard_after_forward=2)
    ctx.impl.ns.fully_shard(model, mesh=mesh["dp"])
    x = torch.randn(2, 8).to(ctx.device)
    try:
        model(x)
    except NotImplementedError as e:
        assert "Resharding to smaller mesh is not supported for DTensor parameters" in str(e), (
            f"{ctx.where()} NotImplementedError with an unexpected message: {e}"
        )
        return
    raise AssertionError(
        f"{ctx.where()} forward with reshard_after_forward=2 over TP parameters "
        "ran; expected NotImplementedError (resharding to a smaller mesh)"
    )


SEQ = 4  # sequence length, split over tp by SequenceParallel


class SPBlock(nn.Module):
    """``norm`` LayerNorm(dim) (SequenceParallel: Replicate parameters, Shard(1) activations) ->
    ``proj`` Linear(dim, dim) (ColwiseParallel from Shard(1) inputs to a Replicate output)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.norm(x))


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.TRAINING, base.FSDP2_API},
    world_sizes=(2, 4),
)
def train_parity_sequence_parallel(ctx):
    """FSDP over a sequence-parallel norm trains like the plain model (P15, P6).

    The norm's weight and bias are Replicate on tp while its input is sharded on the sequence
    dim, so their gradients arrive as Partial sums over tp: FSDP must turn them into the
    parameters' Replicate placement before reducing over dp. Losses, gathered gradients and
    parameters after 3 SGD steps (momentum 0.9) equal the plain model's on the whole batch; the
    norm parameters are ``(Shard(0), Replicate())`` on the (dp, tp) mesh: (1, 2) at world size 2,
    (2, 2) at 4."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dim = 6
    dp = ctx.world_size // TP
    mesh = ctx.make_mesh((dp, TP), ("dp", "tp"))
    ctx.seed(0)
    model = SPBlock(dim).to(ctx.device)
    with torch.no_grad():  # not the default ones and zeros, so a wrong norm gradient shows
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    oracle = copy.deepcopy(model)
    plan = {
        "norm": SequenceParallel(),
        "proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    ctx.impl.ns.fully_shard(model, mesh=mesh["dp"])
    for name in ("norm.weight", "norm.bias"):
        placements = tuple(model.get_parameter(name).placements)
        assert placements == (Shard(0), Replicate()), (
            f"{ctx.where()} {name}: placements {placements}, expected (Shard(0), Replicate())"
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    dp_rank, tp_rank = divmod(ctx.rank, TP)
    samples = slice(dp_rank * B, (dp_rank + 1) * B)
    tokens = slice(tp_rank * SEQ // TP, (tp_rank + 1) * SEQ // TP)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(dp * B, SEQ, dim, generator=g).to(ctx.device)
        y = torch.randn(dp * B, SEQ, dim, generator=g).to(ctx.device)
        out = model(x[samples, tokens])  # this rank's sequence chunk of its dp samples
        loss = F.mse_loss(out, y[samples])
        loss.backward()
        oout = oracle(x)
        F.mse_loss(oout, y).backward()
        assert_close(
            ctx, f"step {step} loss", loss, F.mse_loss(oout[samples].detach(), y[samples]), TOL
        )
        _compare_grads_then_step(ctx, model, oracle, (opt, oopt), step)
    for name, param in model.named_parameters():
        full = param.detach().full_tensor()
        assert_close(ctx, f"{name} after {STEPS} steps", full, oracle.get_parameter(name), TOL)


def _compare_grads_then_step(ctx, model, oracle, optimizers, step: int) -> None:
    """Every parameter's full gradient equals the oracle's; then step and zero both optimizers."""
    for name, param in model.named_parameters():
        assert_close(
            ctx,
            f"step {step} {name} gradient (full_tensor)",
            param.grad.full_tensor(),
            oracle.get_parameter(name).grad,
            TOL,
        )
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


BF16_TOL = dict(rtol=2e-2, atol=2e-3)  # the oracle's mixed-precision rule (outputs, gradients)


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.MIXED_PRECISION, base.TRAINING, base.FSDP2_API},
    world_sizes=(4,),
)
def mixed_precision_over_tp(ctx):
    """P128: FSDP with ``MixedPrecisionPolicy(param_dtype=bf16)`` over TP parameters (the Note's
    model and 2 x 2 mesh, ``dim=8, hidden=12``): during forward each unsharded parameter is a
    DTensor of dtype bf16 on the 1-D tp mesh with its TP placement (``in_proj`` ``Shard(0)``,
    ``out_proj.weight`` ``Shard(1)``, ``out_proj.bias`` ``Replicate()``) and the original's
    global shape; the output is bf16 and the gradients (kept in the fp32 original dtype) equal
    the oracle's computed in bf16 (its parameters and the global batch cast to bf16, the mean
    squared error in fp32), within the mixed-precision tolerances (rtol 2e-2, atol 2e-3)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ns, bf16 = ctx.impl.ns, torch.bfloat16
    dim, hidden = 8, 12
    mesh = ctx.make_mesh((DP, TP), ("dp", "tp"))
    ctx.seed(0)
    model = TPMLP(dim, hidden).to(ctx.device)
    oracle = copy.deepcopy(model).to(bf16)
    parallelize_module(
        model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    ns.fully_shard(model, mesh=mesh["dp"], mp_policy=ns.MixedPrecisionPolicy(param_dtype=bf16))
    seen = {}

    def record(module, args, prefix):
        for pname, param in module.named_parameters(recurse=False):
            seen[f"{prefix}.{pname}"] = param

    for prefix in ("in_proj", "out_proj"):
        getattr(model, prefix).register_forward_pre_hook(
            lambda module, args, prefix=prefix: record(module, args, prefix)
        )
    want = {
        "in_proj.weight": (Shard(0),),
        "in_proj.bias": (Shard(0),),
        "out_proj.weight": (Shard(1),),
        "out_proj.bias": (Replicate(),),
    }
    x, y, mine = _batch(ctx, 0, dim)
    out = model(x[mine])
    for name, placements in want.items():
        param, full = seen.get(name), oracle.get_parameter(name)
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {name} in forward is {type(param).__name__}, expected a DTensor"
        )
        got = (param.dtype, tuple(param.placements), param.device_mesh.ndim, tuple(param.shape))
        assert got == (bf16, placements, 1, tuple(full.shape)), (
            f"{ctx.where()} {name} in forward: (dtype, placements, mesh ndim, shape) {got}, "
            f"expected {(bf16, placements, 1, tuple(full.shape))}"
        )
    assert out.dtype == bf16, f"{ctx.where()} forward output is {out.dtype}, expected bf16"
    oout = oracle(x.to(bf16))
    assert_close(ctx, "bf16 forward output", out, oout[mine], BF16_TOL)
    F.mse_loss(out.float(), y[mine]).backward()
    F.mse_loss(oout.float(), y).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32, (
            f"{ctx.where()} {name}.grad is {getattr(param.grad, 'dtype', None)}, expected fp32"
        )
        assert_close(
            ctx,
            f"{name} gradient (full_tensor, vs the bf16 oracle)",
            param.grad.full_tensor(),
            oracle.get_parameter(name).grad,
            BF16_TOL,
        )


@check(
    area="tensor_parallel",
    requires={base.TENSOR_PARALLEL, base.FSDP2_API},
    world_sizes=(1, 2),
)
def three_dim_tp_refused(ctx):
    """P127: ``fully_shard(module, mesh=<dp mesh>)`` over a module whose parameters are DTensors
    on a 3-D model-parallel mesh (``("dp", "a", "b", "c")`` of shape ``(ws, 1, 1, 1)``, the
    parameters ``Replicate()`` on ``("a", "b", "c")``) raises NotImplementedError naming the
    parameter's placements ``(Replicate(), Replicate(), Replicate())``: FSDP composes with
    1-D tensor parallelism (2-D EP+TP upstream), never more."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = ctx.make_mesh((ctx.world_size, 1, 1, 1), ("dp", "a", "b", "c"))
    ctx.seed(0)
    module = nn.Linear(4, 4).to(ctx.device)
    for name, param in list(module.named_parameters()):
        full = distribute_tensor(param.detach(), mesh["a", "b", "c"], [Replicate()] * 3)
        setattr(module, name, nn.Parameter(full))
    try:
        ctx.impl.ns.fully_shard(module, mesh=mesh["dp"])
    except NotImplementedError as exc:
        assert "(Replicate(), Replicate(), Replicate())" in str(exc), (
            f"{ctx.where()} NotImplementedError {str(exc)[:300]!r} does not name the placements "
            "(Replicate(), Replicate(), Replicate())"
        )
        return
    raise AssertionError(
        f"{ctx.where()} fully_shard over 3-D TP DTensor parameters was accepted; expected "
        "NotImplementedError (FSDP composes with 1-D TP only, or 2-D EP+TP)"
    )
