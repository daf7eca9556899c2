"""Tiny checks for tests/harness/test_api_coverage.py: what the API trace records of a case.

Each check calls or passes a few known entries of upstream's API (through the adapter's ``ns``)
and asserts something trivially true of the result, so that it passes on the upstream adapters;
the test reads the trace of each case and compares it with what the check's code does. They are
collected only with ``--check-dir tests/harness/apichecks``.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.registry import check


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@check(area="apitrace", requires={base.FSDP2_API}, world_sizes=[1])
def fsdp2_calls(ctx):
    """fully_shard with a non-default reshard_after_forward and a MixedPrecisionPolicy with
    param_dtype set, then set_requires_gradient_sync on the root: all three are recorded, the
    keywords left at their default (shard_placement_fn) are not."""
    ns = ctx.impl.ns
    model = _model()
    mp = ns.MixedPrecisionPolicy(param_dtype=torch.float64)
    ns.fully_shard(model, mesh=ctx.mesh, reshard_after_forward=False, mp_policy=mp)
    model.set_requires_gradient_sync(False)
    out = model(torch.ones(2, 4))
    assert out.shape == (2, 2), f"rank {ctx.rank}: output shape {tuple(out.shape)}, expected (2, 2)"


@check(area="apitrace", requires={base.FSDP1_API}, world_sizes=[1])
def fsdp1_calls(ctx):
    """FullyShardedDataParallel with ShardingStrategy.SHARD_GRAD_OP and a size-based policy
    (functools.partial with min_num_params), then a FULL_STATE_DICT through state_dict_type:
    the strategy member, the policy and its keyword and the context manager are recorded;
    set_state_dict_type, which state_dict_type calls inside torch, is not."""
    import functools

    ns = ctx.impl.ns
    policy = functools.partial(ns.wrap.size_based_auto_wrap_policy, min_num_params=1)
    model = ns.FullyShardedDataParallel(
        _model(),
        device_id=torch.device("cpu"),
        sharding_strategy=ns.ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=policy,
    )
    with ns.FullyShardedDataParallel.state_dict_type(
        model, ns.StateDictType.FULL_STATE_DICT, ns.FullStateDictConfig(rank0_only=False)
    ):
        sd = model.state_dict()
    assert "0.weight" in sd, f"rank {ctx.rank}: keys {sorted(sd)}, expected 0.weight among them"


@check(area="apitrace", requires={base.FSDP2_API}, world_sizes=[1])
def calls_nothing(ctx):
    """A check that touches no entry of the API: its trace is empty."""
    assert ctx.world_size == 1, f"rank {ctx.rank}: world size {ctx.world_size}, expected 1"
