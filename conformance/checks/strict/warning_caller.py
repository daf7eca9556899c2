"""Area "strict": a warning about how a public API was called points at that call (X5).

[Note: caller attribution]
``warnings.warn(..., stacklevel=n)`` reports the file and line ``n`` frames up; a warning about
the caller's arguments is useful only when that frame is the caller's call of the public API (the
file a user reads), not a line inside the implementation. The checks here call the API from this
file and require the recorded warning's ``filename`` to be this file:
* FSDP1 at world size 1 with the default strategy: "FSDP is switching to use `NO_SHARD` ...";
* FSDP1 at world size 2 with ``sharding_strategy=NO_SHARD``: the FutureWarning that NO_SHARD is
  deprecated;
* ``full_optim_state_dict(..., optim_input=)``: the FutureWarning that ``optim_input`` is
  deprecated (S51).
Upstream does not promise this; where it points elsewhere (torch 2.13: the world-size-1 warning
at its own fully_sharded_data_parallel.py) the case is pinned in its expectations file.
"""

from __future__ import annotations

import os
import warnings

from torch import nn

from conformance.adapters import base
from conformance.checks.state_dict.optim_groups import REQUIRES as OPTIM
from conformance.checks.state_dict.optim_groups import _groups, _trained
from conformance.checks.wrap._helpers import device_id
from conformance.registry import check

AREA = "strict"


def _assert_attributed(ctx, record, needle, what):
    hits = [w for w in record if needle in str(w.message)]
    assert hits, f"{ctx.where()} {what}: no warning containing {needle!r}"
    places = sorted({f"{w.filename}:{w.lineno}" for w in hits})
    here = os.path.abspath(__file__)
    assert all(os.path.abspath(w.filename) == here for w in hits), (
        f"{ctx.where()} {what}: the warning ({needle!r}) is attributed to {places}, expected "
        f"the caller's call in {os.path.basename(here)}"
    )


@check(area=AREA, requires={base.FSDP1_API}, world_sizes=(1, 2))
def fsdp1_strategy_warning_caller(ctx):
    """X5: FSDP1's sharding-strategy warnings (ws 1: switching to NO_SHARD; ws 2 with NO_SHARD:
    NO_SHARD is deprecated) are attributed to the constructor's caller."""
    ns = ctx.impl.ns
    kwargs = {"device_id": device_id(ctx)}
    if ctx.world_size == 1:
        needle, what = "switching to use `NO_SHARD`", "FSDP(model) at world size 1"
    else:
        needle, what = "`NO_SHARD` sharding strategy is deprecated", "FSDP(NO_SHARD)"
        kwargs["sharding_strategy"] = ns.ShardingStrategy.NO_SHARD
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ns.FullyShardedDataParallel(nn.Linear(4, 4), **kwargs)
    _assert_attributed(ctx, record, needle, what)


@check(area=AREA, requires=OPTIM, world_sizes=(1,))
def fsdp1_optim_input_warning_caller(ctx):
    """X5, S51: the FutureWarning of ``full_optim_state_dict(..., optim_input=)`` is attributed
    to its caller."""
    _, _, model, opt = _trained(ctx, count=False)
    params = [p for g in _groups(model.named_parameters()) for p in g["params"]]
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fsdp.full_optim_state_dict(model, opt, optim_input=params, rank0_only=False)
    _assert_attributed(ctx, record, "optim_input", "full_optim_state_dict(optim_input=)")
