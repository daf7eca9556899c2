"""Area "fsdp1_runtime": what ``register_comm_hook`` refuses: a call on a non-root unit, a hook that
is not callable, a root with a hybrid sharding strategy (R96).

The refusals are pinned as ``init_errors.py``'s [Note: refusals are contracts] says; a hook
registered after them is ``knobs.recording_comm_hook`` (R27's), which records each call.
"""

from __future__ import annotations

from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs, _nested
from conformance.checks._shared.models import expect_error
from conformance.checks.fsdp1.knobs import recording_comm_hook
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
