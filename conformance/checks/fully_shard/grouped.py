"""Area "states": a grouped ``fully_shard([a, b])`` whose forward runs only some of its modules
(P22).

[Note: partial group forward]
A group made by one ``fully_shard([a, b])`` call shares one parameter group: the unshard happens
before the first of its modules runs and the post-forward (reshard per ``reshard_after_forward``,
pre-backward hook on the output) after the last. When a forward runs only ``a`` (``b`` is skipped,
or it is a head the training loop calls on its own after the model's forward, as a chunked loss
does), the group's post-forward never fires by itself: the root's post-forward completes it, so
right after the root's forward the group is SHARDED (its default ``reshard_after_forward=True``),
every iteration alike, and backward still gives every parameter the oracle's gradient (``.grad``
None for a module that did not run). A head called after the root's forward makes its group's
state the forward root of that call; the root's final callback in backward ends it, so the next
iteration's root forward is again the root's.

The oracle is the unsharded model (``_shared/oracle.py``'s rule: rank r feeds its ``B`` samples,
the oracle the global batch, losses are means), stepped with the same SGD.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import B, backward_and_compare
from conformance.registry import check

GROUP = ("a.weight", "a.bias", "b.weight", "b.bias")
STEPS = 2


class Trunk(nn.Module):
    """Root Linear(5, 7) -> tanh -> ``a`` Linear(7, 7) -> tanh; ``b`` Linear(7, 3) is called by
    ``forward`` only with ``run_b`` (otherwise it is a head for the caller to run)."""

    def __init__(self, run_b: bool = False):
        super().__init__()
        self.run_b = run_b
        self.inp = nn.Linear(5, 7)
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.inp(x))))
        return self.b(h) if self.run_b else h


def _batch(ctx, step, out_dim):
    g = torch.Generator().manual_seed(2000 + step)
    n = ctx.world_size * B
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, out_dim, generator=g)
    return x.to(ctx.device), y.to(ctx.device)


def _assert_group_sharded(ctx, model, when):
    from torch.distributed.tensor import DTensor

    for fqn in GROUP:
        param = model.get_parameter(fqn)
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {fqn} {when}: registered a plain tensor (UNSHARDED); the group "
            f"fully_shard([a, b]) should be SHARDED once the root's forward has finished it"
        )


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    cases={
        "b-skipped": {"head": False},
        "b-called-after-forward": {"head": True},
        "both-run": {"head": False, "run_b": True},
    },
)
def group_partial_forward(ctx, head, run_b=False):
    """P22: with ``fully_shard([a, b])`` and the root over them, a forward that runs only ``a``
    leaves the group SHARDED right after the root's forward, in both of 2 iterations; losses,
    sharded gradients (the oracle's chunks; ``b``'s None when it never ran) and the values after
    each SGD step equal the unsharded model's. ``b-called-after-forward``: ``b`` runs on the
    root's output after the root's forward (a chunked-loss head). ``both-run``: the control, the
    root's forward runs ``a`` then ``b``, so the group's own post-forward (after ``b``) reshards
    it, with the same assertions."""

    ctx.seed(0)
    model = Trunk(run_b).to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(STEPS):
        x, y = _batch(ctx, step, 3 if head or run_b else 7)
        out = model(x[mine])
        _assert_group_sharded(ctx, model, f"after the root's forward of step {step}")
        oout = oracle(x)
        if head:
            out, oout = model.b(out), oracle.b(oout)
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)
