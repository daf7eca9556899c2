"""Area "fsdp1_runtime": what ``register_comm_hook`` refuses: a call on a non-root unit, a hook that
is not callable, a root with a hybrid sharding strategy (R96); and the grad mode a hook runs in
(R118).

The refusals are pinned as ``init_errors.py``'s [Note: refusals are contracts] says; a hook
registered after them is ``knobs.recording_comm_hook`` (R27's), which records each call.

[Note: the grad mode of a comm hook]
A registered hook reduces gradients; nothing it does is to be recorded by autograd, so it runs
with grad mode off even inside ``backward(create_graph=True)`` (where autograd runs hooks with
grad mode on). FSDP1 refuses gradients of gradients, so the case that shows it is a loss whose
gradient does not depend on the parameters (``model(x).sum()`` of a Linear): the backward
completes with the unsharded model's gradients and the hook saw grad mode off (R118).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs, _nested
from conformance.checks._shared.models import expect_error
from conformance.checks.fsdp1.knobs import recording_comm_hook
from conformance.checks.fsdp1.training import assert_flat_grads
from conformance.registry import check


# ------------------------------------------------------------------------------ R96
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def comm_hook_refusals(ctx):
    """R96: over ``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))`` after a forward,
    ``register_comm_hook`` on the inner unit raises AssertionError "register_comm_hook can only
    be called on a root instance." and on the root with the hook ``5`` ValueError "... must be
    callable but got 5". Neither registers anything: the root then accepts a callable hook,
    which the next backward calls once per unit."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = _nested(ctx, fsdp)
    model(_batch(ctx, 96))
    calls = []

    hook = recording_comm_hook(calls)

    expect_error(
        ctx,
        "register_comm_hook on the inner unit",
        AssertionError,
        r"register_comm_hook can only be called on a root instance",
        lambda: model.module[0].register_comm_hook(None, hook),
    )
    expect_error(
        ctx,
        "register_comm_hook(None, 5) on the root",
        ValueError,
        r"must be callable but got 5",
        lambda: model.register_comm_hook(None, 5),
    )
    model.register_comm_hook("token", hook)
    model(_batch(ctx, 97)).sum().backward()
    assert calls == ["token", "token"], (
        f"{ctx.where()} the hook registered after the refusals got states {calls}, expected it "
        "once per unit (2) with 'token'"
    )


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_HYBRID_SHARD}, world_sizes=(4,))
def comm_hook_hybrid_refused(ctx):
    """R96: ``register_comm_hook`` on a root built with ``HYBRID_SHARD`` over a (2, 2)
    (replicate, shard) mesh raises AssertionError "Communication hook is not supported for
    hybrid strategies"."""
    ns = ctx.impl.ns
    model = ns.FullyShardedDataParallel(
        nn.Linear(4, 4).to(ctx.device),
        sharding_strategy=ns.ShardingStrategy.HYBRID_SHARD,
        device_mesh=ctx.make_mesh((2, 2), ("replicate", "shard")),
        **_kwargs(ctx),
    )
    expect_error(
        ctx,
        "register_comm_hook on a HYBRID_SHARD root",
        AssertionError,
        r"Communication hook is not supported for hybrid strategies",
        lambda: model.register_comm_hook(None, lambda *args: None),
    )


# ------------------------------------------------------------------------------ R118
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def comm_hook_grad_mode_off(ctx):
    """R118: a comm hook registered on ``FSDP(Linear(4, 3))`` runs with grad mode off also
    under ``model(x).sum().backward(create_graph=True)`` (``x`` the same on every rank, whose
    gradients do not require grad): ``torch.is_grad_enabled()`` read inside the hook is False
    at each of its calls (one per backward), and the hook's reduction (the mean over ranks: an
    all-reduce of ``grad`` unsharded, a reduce-scatter into ``output`` sharded, then a division
    by the world size) gives the flat parameter the unsharded Linear's gradient (this rank's
    padded chunk)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = nn.Linear(4, 3).to(ctx.device)
    model = fsdp(copy.deepcopy(oracle), **_kwargs(ctx))
    grad_mode: list[bool] = []

    def hook(state, grad, output=None):
        grad_mode.append(torch.is_grad_enabled())
        if output is None:
            dist.all_reduce(grad)
            grad.div_(ctx.world_size)
        else:
            dist.reduce_scatter_tensor(output, grad)
            output.div_(ctx.world_size)

    model.register_comm_hook(None, hook)
    x = _batch(ctx, 118)
    model(x).sum().backward(create_graph=True)
    oracle(x).sum().backward()
    assert grad_mode == [False], (
        f"{ctx.where()} inside backward(create_graph=True) the hook saw grad mode {grad_mode}, "
        "expected one call with it off ([False])"
    )
    assert_flat_grads(ctx, model, oracle, "after backward(create_graph=True) with the hook")
