"""Areas "fsdp1_runtime" and "training": what an FSDP1 unit's forward may be given and how it may
be called, with ``forward_prefetch=True``, keyword tensors, evaluation forwards under
``no_grad`` and tensors nested in containers (R55).

[Note: forward inputs change no value]
``forward_prefetch=True``, keyword tensor arguments and an evaluation forward under
``torch.no_grad()`` between training steps change no value; a nested unit (FSDP1 or
``fully_shard``) called with tensors inside a namedtuple, a list of a tuple, an OrderedDict and a
dataclass gets each in its own container type and trains as the unsharded model (R55).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check


class _KwNet(nn.Module):
    """InnerHeadNet with a keyword tensor added to the output."""

    def __init__(self):
        super().__init__()
        self.net = InnerHeadNet()

    def forward(self, x, *, offset=None):
        out = self.net(x)
        return out if offset is None else out + offset


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    world_sizes=(1, 2),
)
def forward_prefetch_kwargs_no_grad(ctx):
    """R55: ``forward_prefetch=True`` on every unit (``net.inner`` its own unit), the forward
    given a keyword tensor ``offset``; two SGD steps on the global batch with an evaluation
    forward under ``torch.no_grad()`` between them: the evaluation output and the parameters after
    each step equal the unsharded model's."""
    ctx.seed(0)
    oracle = _KwNet().to(ctx.device)
    pf = {"forward_prefetch": True}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("net.inner", pf), ("", pf)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(40 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        off = torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)
        ((model(x[mine], offset=off[mine]) ** 2).sum() / B).backward()
        opt.step()
        opt.zero_grad()
        ((oracle(x, offset=off) ** 2).sum() / (ctx.world_size * B)).backward()
        oopt.step()
        oopt.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{name} after step {step}", got[name], ref, FP32["param"])
        if step == 0:
            with torch.no_grad():
                assert_close(
                    ctx,
                    "no_grad forward between steps",
                    model(x[mine], offset=off[mine]),
                    oracle(x[mine], offset=off[mine]),
                    FP32["loss"],
                )


# ------------------------------------------------------------------ structured unit arguments
class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class _Box:
    t: torch.Tensor
    tag: str


class _StructBlock(nn.Module):
    """Reads every tensor of its structured arguments; records the container types it got."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple] = []

    def forward(self, pair, items, *, extra, box):
        self.seen.append((type(pair), type(items), type(items[1]), type(extra), type(box), box.tag))
        h = self.lin(pair.a * 2.0 + pair.b) + items[0] * 3.0 + items[1][0]
        return torch.tanh(h) * extra["s"] + box.t * 0.5 + extra["k"]


class _StructNet(nn.Module):
    """pre Linear(4, 8) split in two halves feeding ``block`` (its own unit) through a namedtuple,
    a list holding a tuple, an OrderedDict and a dataclass, each field its own tensor."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 8)
        self.block = _StructBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        u, v = self.pre(x).chunk(2, dim=-1)
        extra = collections.OrderedDict(s=torch.sigmoid(v), k=1)
        out = self.block(_Pair(u, v), [v * u, (u - v,)], extra=extra, box=_Box(u + v, "box"))
        return self.head(out)


@check(area="training", requires={base.TRAINING}, world_sizes=(1, 2))
def structured_unit_arguments(ctx):
    """R55: a nested unit (FSDP1 unit or fully_shard module) called with tensors that require
    grad inside a namedtuple, a list holding a tuple, an ``OrderedDict`` keyword argument (with a
    non-tensor entry) and a dataclass keyword argument (with a string field): the wrapped forward
    gets each argument in its own container type with every field in its place, and two SGD
    steps on the global batch (each rank its own samples) equal the unsharded model's."""
    ctx.seed(0)
    oracle = _StructNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("block", {}), ("", {})])
    block = next(m for m in model.modules() if isinstance(m, _StructBlock))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    want = (_Pair, list, tuple, collections.OrderedDict, _Box, "box")
    for step in range(2):
        g = torch.Generator().manual_seed(60 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        block.seen.clear()
        (model(x[mine]) ** 2).sum().div(B).backward()
        assert block.seen == [want], (
            f"{ctx.where()} step {step}: the unit's forward got {block.seen}, expected {want}"
        )
        opt.step()
        opt.zero_grad()
        (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
        oopt.step()
        oopt.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{name} after step {step}", got[name], ref, FP32["param"])
