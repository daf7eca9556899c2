"""Area "training": what a ``fully_shard`` module may return from forward (P25), down to the
max depth of containers FSDP walks (128).

[Note: pytree outputs]
FSDP2 hooks backward through a unit's outputs: it registers its pre-backward hook on every output
tensor that requires grad, wherever it sits in the returned pytree (tuple, list, dict). Every other
leaf is not FSDP's business and comes back untouched: a tensor that does not require grad (an
``argmax`` index, a detached statistic), an int, a string, ``None``. A forward under
``torch.enable_grad()`` that returns such leaves next to the loss-bearing tensor therefore runs and
trains exactly like the unsharded model. Here the unit ``enc`` returns a dict with all of them and
the root returns a tuple with a non-grad tensor, an int and ``None``; expected values come from the
unsharded oracle (``_shared/oracle.py``'s rule: rank r feeds its ``B`` samples, the oracle the
global batch, losses are means).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import B, backward_and_compare
from conformance.registry import check

STEPS = 2


class Encoder(nn.Module):
    """Linear(5, 7) -> tanh, returned in a dict next to leaves that need no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return {"h": h, "idx": h.argmax(-1), "n": 3, "tag": "enc", "none": None}


class Net(nn.Module):
    """``enc`` then ``head`` Linear(7, 3); returns ``(out, idx, n, None)``."""

    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        e = self.enc(x)
        assert e["n"] == 3 and e["tag"] == "enc" and e["none"] is None, f"enc returned {e}"
        return self.head(e["h"]), e["idx"], e["n"] + 1, None


def _batch(ctx, step):
    g = torch.Generator().manual_seed(3100 + step)
    n = ctx.world_size * B
    return torch.randn(n, 5, generator=g).to(ctx.device), torch.randn(n, 3, generator=g).to(
        ctx.device
    )


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def pytree_outputs_with_non_grad_leaves(ctx):
    """P25: a unit returning a dict of a grad tensor, an ``argmax`` index tensor, an int, a str and
    ``None``, under a root returning ``(out, idx, int, None)``, runs forward with grad enabled: the
    non-grad leaves come back unchanged (the index equals the oracle's, ``idx.requires_grad`` is
    False, the int/str/None are as returned), and over 2 SGD steps the losses, sharded gradients
    (the oracle's chunks) and parameters equal the unsharded model's."""
    ctx.seed(0)
    model = Net().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model.enc, mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(STEPS):
        x, y = _batch(ctx, step)
        with torch.enable_grad():
            out, idx, n, none = model(x[mine])
        oout, oidx, _, _ = oracle(x)
        assert n == 4 and none is None, (
            f"{ctx.where()} step {step}: the root returned n={n!r}, last={none!r}; expected 4, None"
        )
        assert not idx.requires_grad and torch.equal(idx.cpu(), oidx[mine].cpu()), (
            f"{ctx.where()} step {step}: the argmax leaf is {idx.tolist()} "
            f"(requires_grad={idx.requires_grad}); expected {oidx[mine].tolist()}, no grad"
        )
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)


# P25: FSDP walks at most this many containers down a forward output (the output itself is at
# depth 0); anything at this depth is refused as a likely cycle.
MAX_DEPTH = 128


class Box(NamedTuple):
    inner: Any


@dataclasses.dataclass
class Cell:
    """P74: a dataclass level, one container deep like a list or a namedtuple."""

    inner: Any


class Nested(nn.Module):
    """Linear(5, 3) whose output is wrapped in ``depth`` containers of one ``kind``: lists,
    ``Box`` namedtuples or ``Cell`` dataclasses."""

    def __init__(self, depth: int, kind: str):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.depth, self.kind = depth, kind

    def forward(self, x):
        out = self.lin(x)
        wrap = {"list": lambda o: [o], "namedtuple": Box, "dataclass": Cell}[self.kind]
        for _ in range(self.depth):
            out = wrap(out)
        return out


def unwrap(out, depth: int):
    for _ in range(depth):
        out = out.inner if isinstance(out, Cell) else out[0]
    return out


DEPTH_CASES = {
    f"{kind}-{depth}": {"depth": depth, "kind": kind}
    for kind in ("list", "namedtuple", "dataclass")
    for depth in (MAX_DEPTH - 1, MAX_DEPTH)
}


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    cases=DEPTH_CASES,
)
def deeply_nested_output(ctx, depth, kind):
    """P25, P74: a unit whose forward (grad enabled) returns its output tensor inside ``depth``
    nested lists, namedtuples or dataclasses (each level counted once, a dataclass like any other
    container): at depth 127 it trains one SGD step like the unsharded model; at depth 128 (the
    max depth FSDP walks) the forward raises RuntimeError naming the max depth (128)."""
    ctx.seed(0)
    model = Nested(depth, kind).to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, y = _batch(ctx, 0)
    if depth >= MAX_DEPTH:
        expect_error(
            ctx,
            f"an output {depth} containers deep",
            RuntimeError,
            rf"(?i)max.*depth.*\({MAX_DEPTH}\)",
            lambda: model(x[mine]),
        )
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    out, oout = unwrap(model(x[mine]), depth), unwrap(oracle(x), depth)
    backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), 0)
