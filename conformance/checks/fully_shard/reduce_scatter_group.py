"""Area "training": the reduce-scatter's own process group (``set_separate_reduce_scatter_group``,
P32) kept when the setter is called again (P125).

[Note: observing the group]
The group of every all-gather and reduce-scatter is read at the dispatcher (``GroupSpy`` of
``setters_effect.py``: the ``group_name`` of each collective op), so the check sees which group
the gradients are reduced on, not how the implementation stores it. Group names are unique per
process group, so "the same name" means "the same group".
"""

from __future__ import annotations

import copy

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    MLP,
    PLANS,
    B,
    backward_and_compare,
    make_batch,
    make_optimizer,
)
from conformance.checks.fully_shard.setters_effect import GroupSpy
from conformance.registry import check

REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API}


@check(area="training", requires=REQUIRES)
def separate_reduce_scatter_group_kept(ctx):
    """P125: ``set_separate_reduce_scatter_group()`` called again (enable=True, recursive, on the
    root of the nested MLP) while the units already reduce-scatter on a group of their own keeps
    that group: before each of two SGD steps the root calls it, and the reduce-scatters of the
    second step run on exactly the group(s) of the first, which the all-gathers never use; each
    step gives the oracle's sharded gradients and parameters (``backward_and_compare``). At
    world size 1 nothing is communicated and only the values are judged."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    optimizers = [
        make_optimizer("sgd", model.parameters()),
        make_optimizer("sgd", oracle.parameters()),
    ]
    mine = slice(rank * B, (rank + 1) * B)
    scatters = []
    for step in range(2):
        model.set_separate_reduce_scatter_group()
        x, y = make_batch("mlp", ws, step, ctx.device)
        with GroupSpy() as spy:
            out = model(x[mine])
            oout = oracle(x)
            backward_and_compare(ctx, model, oracle, (out, oout, y, mine), optimizers, step)
        scatters.append(spy.groups["reducescatter"])
        if ws == 1:
            continue  # nothing is communicated
        assert spy.groups["reducescatter"], f"{ctx.where()} step {step}: no reduce-scatter seen"
        shared = spy.groups["reducescatter"] & spy.groups["allgather"]
        assert not shared, (
            f"{ctx.where()} step {step}: reduce-scatters on {sorted(shared)}, a group the "
            "all-gathers use too; expected a group of their own"
        )
    if ws > 1:
        assert scatters[1] == scatters[0], (
            f"{ctx.where()} after calling set_separate_reduce_scatter_group() again the "
            f"reduce-scatters run on {sorted(scatters[1])}, before on {sorted(scatters[0])}; "
            "expected the group kept"
        )
