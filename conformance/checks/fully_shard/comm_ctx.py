"""Area "training": ``share_comm_ctx`` over several FSDP roots (P67).

[Note: pipeline stages sharing one context]
A pipeline-parallel rank holds several model chunks, each its own ``fully_shard`` root.
``share_comm_ctx([a, b])`` makes them collect through one communication context (upstream: one
set of accelerator streams). That is a scheduling matter only: the call returns None, and the
roots then train exactly like the unsharded model. An entry that is not an ``FSDPModule`` is
rejected with ValueError before anything is shared.

The model: stage ``0`` Linear(5, 7), ``1`` Tanh, stage ``2`` Linear(7, 3), each Linear its own root
(no unit over the Sequential), so one forward runs root ``0`` then root ``2``. The oracle is the
unsharded Sequential (``_shared/oracle.py``'s rule: rank r feeds its ``B`` samples, the oracle the
global batch), stepped with the same SGD.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import B, backward_and_compare
from conformance.registry import check

STEPS = 2


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def share_comm_ctx_between_roots(ctx):
    """P67: with stages ``0`` and ``2`` of a Sequential each a ``fully_shard`` root,
    ``share_comm_ctx([model[0], model[2]])`` returns None, and 2 training steps through both
    roots give the unsharded model's losses, sharded gradient chunks and values after each SGD
    step; ``share_comm_ctx([model[0], nn.Linear(2, 2)])`` raises ValueError naming the list of
    FSDPModules; ``share_comm_ctx([])`` returns None."""
    ctx.seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(ctx.device)
    oracle = copy.deepcopy(model)
    ns = ctx.impl.ns
    for stage in (model[0], model[2]):
        ns.fully_shard(stage, mesh=ctx.mesh)
    result = ns.share_comm_ctx([model[0], model[2]])
    assert result is None, f"{ctx.where()} share_comm_ctx returned {result!r}, expected None"
    empty = ns.share_comm_ctx([])
    assert empty is None, f"{ctx.where()} share_comm_ctx([]) returned {empty!r}, expected None"
    expect_error(
        ctx,
        "share_comm_ctx with a plain nn.Linear in the list",
        ValueError,
        r"list of FSDPModules",
        lambda: ns.share_comm_ctx([model[0], nn.Linear(2, 2)]),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(3000 + step)
        n = ctx.world_size * B
        x = torch.randn(n, 5, generator=g).to(ctx.device)
        y = torch.randn(n, 3, generator=g).to(ctx.device)
        out, oout = model(x[mine]), oracle(x)
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)
