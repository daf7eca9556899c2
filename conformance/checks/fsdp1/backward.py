"""Area "fsdp1_runtime": what FSDP1's backward does with a unit's parameters, and what it refuses:
a unit resharded during backward (R53) and a gradient of a gradient (R98).

[Note: resharding in backward]
A unit whose parameters are all frozen has no gradient to reduce, yet it reshards during backward
as soon as the gradient of its inputs is known, before the backward reaches an earlier layer
(R53). Likewise a SHARD_GRAD_OP unit (which keeps its gathered parameters from forward to
backward) whose output is left out of the loss holds only its shard once backward has finished.

A backward with ``create_graph=True`` is refused as ``init_errors.py``'s [Note: refusals are
contracts] says (R98).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check


# ------------------------------------------------------------------------------ R98
@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"flat": {"orig": False}, "orig-params": {"orig": True}},
    world_sizes=(1, 2),
)
def double_backward_refused(ctx, orig):
    """R98: one unit over ``Linear(4, 4)`` (``use_orig_params`` False and True): a backward of
    ``out.pow(2).sum()`` with ``create_graph=True`` (its gradient itself needs a gradient)
    raises RuntimeError "FSDP does not support gradients of gradients" on every rank."""
    ctx.seed(0)
    model = ctx.impl.ns.FullyShardedDataParallel(
        nn.Linear(4, 4).to(ctx.device), use_orig_params=orig, **_kwargs(ctx)
    )
    expect_error(
        ctx,
        "backward(create_graph=True)",
        RuntimeError,
        r"FSDP does not support gradients of gradients",
        lambda: model(_batch(ctx, 98)).pow(2).sum().backward(create_graph=True),
    )


class _FrozenMiddle(nn.Module):
    """pre Linear(4, 4) -> inner Linear(4, 6) (frozen, its own unit) -> tanh -> head Linear(6, 3)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.inner.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(self.pre(x))))


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    cases={"flat": {"orig": False}, "orig_params": {"orig": True}},
    world_sizes=(2,),
)
def frozen_unit_reshards_in_backward(ctx, orig):
    """R53: ``_FrozenMiddle`` with the frozen ``inner`` its own FULL_SHARD unit, an input that
    requires grad: when the input's gradient is computed (a hook on it, after the backward passed
    ``inner``), ``inner``'s flat parameter holds only this rank's ``ceil(30/ws)`` elements; the
    input's gradient and one SGD step equal the unsharded model's (``inner`` unchanged)."""
    ctx.seed(0)
    oracle = _FrozenMiddle().to(ctx.device)
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})], use_orig_params=orig
    )
    units = ctx.impl.FSDP.fsdp_modules(model)
    inner = next(u for u in units if u is not model)
    seen: list[int] = []
    g = torch.Generator().manual_seed(8)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    y = torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)
    mine = x[ctx.rank * B : (ctx.rank + 1) * B].clone().requires_grad_(True)
    mine.register_hook(lambda grad: seen.append(inner._flat_param.numel()))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    # each rank's mean over its samples: FSDP averages the ranks' gradients
    loss = ((model(mine) - y[ctx.rank * B : (ctx.rank + 1) * B]) ** 2).sum() / B
    loss.backward()
    expected = math.ceil(30 / ctx.world_size)
    assert seen == [expected], (
        f"{ctx.where()} when the input's gradient was computed the frozen unit's flat parameter "
        f"held {seen} elements, expected its {expected}-element shard (resharded in backward)"
    )
    ox = x.clone().requires_grad_(True)
    ((oracle(ox) - y) ** 2).sum().div(ctx.world_size * B).backward()
    own = ox.grad[ctx.rank * B : (ctx.rank + 1) * B] * ctx.world_size
    assert_close(ctx, "input gradient", mine.grad, own, FP32["grad"])
    opt.step()
    torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.1).step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after one step", got[name], ref, FP32["param"])


class _SideOutput(nn.Module):
    """head(tanh(trunk(x))) and, computed but left out of the loss, side(x)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.side = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(x))), self.side(x)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    world_sizes=(2,),
)
def unit_outside_loss_resharded(ctx):
    """R53: ``trunk`` and ``side`` (30 elements each) their own SHARD_GRAD_OP units (which keep
    the gathered parameters from forward to backward), ``side``'s output computed but left out of
    the loss: after backward every unit's flat parameter holds only this rank's ``ceil(N/ws)``
    elements, ``side`` included, and one SGD step equals the unsharded model's (``side``
    unchanged)."""
    ctx.seed(0)
    oracle = _SideOutput().to(ctx.device)
    zero2 = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.SHARD_GRAD_OP}
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("trunk", zero2), ("side", zero2), ("", {})]
    )
    units = ctx.impl.FSDP.fsdp_modules(model)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    (model(x[mine])[0] ** 2).sum().div(B).backward()
    for u in units:
        if u is model:
            continue
        want = math.ceil(30 / ctx.world_size)
        got = u._flat_param.numel()
        assert got == want, (
            f"{ctx.where()} after backward a SHARD_GRAD_OP unit's flat parameter holds {got} "
            f"elements, expected its {want}-element shard"
        )
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    (oracle(x)[0] ** 2).sum().div(ctx.world_size * B).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after one step", got[name], ref, FP32["param"])
