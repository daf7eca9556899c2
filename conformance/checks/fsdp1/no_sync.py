"""Area "fsdp1_runtime": gradients inside and after ``no_sync()``: a unit that the next synced
backward does not use (R66), a parameter tied within one unit (R79, R110), and the synced step
after a bf16 ``no_sync()`` backward (R115).

[Note: no_sync at the edges]
* A unit that got a gradient inside ``no_sync()`` and is not used by the next, synced backward
  never ends up with a gradient of its unsharded size: upstream refuses that backward (R66).
* With ``use_orig_params=True`` a parameter shared by two modules of one unit (``m[1].weight =
  m[0].weight``) gets, inside ``no_sync()``, the same gradient as every other original parameter
  there: the unsharded one, of the parameter's full shape, equal to the unsharded model's gradient
  on the rank's own samples; a later synced backward then reduces the accumulated gradient, and an
  optimizer step gives the unsharded model's parameters (R79). Under NO_SHARD with a bf16
  ``param_dtype`` the gradient inside ``no_sync()`` is likewise the full-shape unsharded one,
  within bf16 tolerance (R110), and the next synced forward and backward reduces what was
  accumulated, tied or not (R115; upstream fails it with a tied weight).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _global_batch, _kwargs, _x
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks.fsdp1.training import (
    BF16_TOLS,
    assert_orig_param_grads,
    assert_params_equal_oracle,
)
from conformance.registry import check


# ------------------------------------------------------------------------------ R66
class _Skippable(nn.Module):
    """``head(inner(x))``, or ``head(x)`` alone when called with ``use_inner=False``."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x, use_inner: bool = True):
        return self.head(self.inner(x) if use_inner else x)


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(2,))
def no_sync_then_unit_unused(ctx):
    """R66: FULL_SHARD at ws 2, ``inner`` its own unit: a backward inside ``model.no_sync()``
    that uses ``inner``, then a synced forward and backward that does not: the synced backward is
    either refused with AssertionError (upstream: the unit's no_sync gradient was never reduced),
    or it completes and every flat parameter's gradient, where there is one, has the shape of the
    rank's shard (never the unit's unsharded size)."""
    ctx.seed(0)
    model = ctx.impl.shard(_Skippable().to(ctx.device), ctx, plan=[("inner", {}), ("", {})])
    x = _x(ctx, 4, 10)
    with model.no_sync():
        model(x).sum().backward()
    try:
        model(x, use_inner=False).sum().backward()
    except AssertionError:
        return
    shards = {tuple(fqns): flat.shape for fqns, flat in ctx.impl.flat_shards(model)}
    for fqns, grad in ctx.impl.flat_grads(model):
        assert grad is None or grad.shape == shards[tuple(fqns)], (
            f"{ctx.where()} after a no_sync backward and a synced one without inner: the flat "
            f"gradient of {fqns} is {tuple(grad.shape)}, the shard {tuple(shards[tuple(fqns)])}"
        )


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum(dim=1).mean()


# ------------------------------------------------------------------------------ R79
def _tied() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight
    return m


def _assert_no_sync_grads(ctx, inner, local, what, tol) -> None:
    """Inside ``no_sync()`` every original parameter of the tied model (by either name of the
    tied one) has a gradient of its full shape equal to ``local``'s (compared in fp32)."""
    for name in ("0.weight", "1.weight", "0.bias", "1.bias"):
        grad = inner.get_parameter(name).grad
        want = local.get_parameter(name).grad
        assert grad is not None, f"{ctx.where()} {what}: {name} has no gradient"
        assert tuple(grad.shape) == tuple(want.shape), (
            f"{ctx.where()} {what}: {name}.grad has shape {tuple(grad.shape)}, expected the "
            f"unsharded {tuple(want.shape)}"
        )
        assert_close(ctx, f"{what} gradient of {name} (rank's samples)", grad.float(), want, tol)


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_NO_SYNC_ORIG_GRADS},
    world_sizes=(2,),
)
def tied_param_no_sync_grad(ctx):
    """R79: ``use_orig_params=True``, FULL_SHARD, one unit over ``Sequential(Linear(4, 4),
    Linear(4, 4))`` with ``m[1].weight = m[0].weight``: a forward and backward inside
    ``no_sync()`` on rank r's samples gives ``m[0].weight`` (and ``m[1].weight``, the same
    parameter) a gradient of shape (4, 4) equal to the unsharded model's gradient on those
    samples, and each bias its unsharded gradient likewise; a following synced backward on a
    second batch gives every parameter the chunk of the unsharded model's gradient summed over
    both batches (mean over all ranks' samples), and an SGD step the unsharded model's parameters."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = ns.FullyShardedDataParallel(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    inner = model.module
    x, y = _global_batch(ctx, 41), _global_batch(ctx, 42)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)

    with model.no_sync():
        _loss(model(x[mine])).backward()
    local = copy.deepcopy(oracle)
    _loss(local(x[mine])).backward()
    _assert_no_sync_grads(ctx, inner, local, "no_sync()", FP32["grad"])

    _loss(model(y[mine])).backward()
    (_loss(oracle(x)) + _loss(oracle(y))).backward()
    assert_orig_param_grads(ctx, model, oracle, "synced backward after no_sync()")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    opt.step()
    oopt.step()
    assert_params_equal_oracle(ctx, model, oracle, "after the SGD step")


def _bf16_no_shard(ctx, oracle: nn.Module) -> nn.Module:
    """One NO_SHARD unit over a copy of ``oracle`` with ``use_orig_params=True`` and a bf16
    ``param_dtype`` (R110, R115)."""
    ns = ctx.impl.ns
    return ns.FullyShardedDataParallel(
        copy.deepcopy(oracle),
        use_orig_params=True,
        sharding_strategy=ns.ShardingStrategy.NO_SHARD,
        mixed_precision=ns.MixedPrecision(param_dtype=torch.bfloat16),
        **_kwargs(ctx),
    )


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_NO_SYNC_ORIG_GRADS, base.MIXED_PRECISION},
    world_sizes=(1, 2),
)
def tied_param_no_sync_grad_bf16(ctx):
    """R110: ``tied_param_no_sync_grad``'s tied model with ``use_orig_params=True``, ``sharding_strategy=NO_SHARD`` and
    ``MixedPrecision(param_dtype=torch.bfloat16)``: a forward and backward inside ``no_sync()``
    on rank r's samples completes and gives the tied parameter (by either name) and each bias a
    gradient of its full shape equal to the unsharded fp32 model's gradient on those samples
    within bf16 tolerance."""
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = _bf16_no_shard(ctx, oracle)
    inner = model.module
    x = _global_batch(ctx, 43)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    with model.no_sync():
        _loss(model(x[mine]).float()).backward()
    _loss(oracle(x[mine])).backward()
    _assert_no_sync_grads(ctx, inner, oracle, "bf16 no_sync()", BF16_TOLS["grad"])


# ------------------------------------------------------------------------------ R115
def _untied() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _bf16_grads(oracle: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient (fp32) of the loss on ``x`` of ``oracle`` computed with bf16 parameters, as a
    ``param_dtype=bfloat16`` unit computes it."""
    low = copy.deepcopy(oracle).to(torch.bfloat16)
    _loss(low(x.to(torch.bfloat16)).float()).backward()
    return {n: p.grad.float() for n, p in low.named_parameters(remove_duplicate=False)}


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_NO_SYNC_ORIG_GRADS, base.MIXED_PRECISION},
    cases={"untied": {"tied": False}, "tied": {"tied": True}},
    world_sizes=(1, 2),
)
def synced_step_after_bf16_no_sync(ctx, tied):
    """R115: one NO_SHARD unit with ``use_orig_params=True`` and
    ``MixedPrecision(param_dtype=torch.bfloat16)`` over two Linears (``tied``: the second's weight
    is the first's): a forward and backward inside ``no_sync()`` on rank r's samples, then one
    outside it on the same samples, completes and leaves each original parameter the ranks' mean
    of the accumulated gradients: the mean over ranks of twice rank r's gradient computed with
    bf16 parameters (each rank computes every rank's from the shared batch), within bf16
    tolerance."""
    ctx.seed(0)
    oracle = (_tied() if tied else _untied()).to(ctx.device)
    model = _bf16_no_shard(ctx, oracle)
    inner = model.module
    x = _global_batch(ctx, 47)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    with model.no_sync():
        _loss(model(x[mine]).float()).backward()
    _loss(model(x[mine]).float()).backward()
    per_rank = [_bf16_grads(oracle, x[r * B : (r + 1) * B]) for r in range(ctx.world_size)]
    for name in ("0.weight", "1.weight", "0.bias", "1.bias"):
        grad = inner.get_parameter(name).grad
        assert grad is not None, f"{ctx.where()} after the synced step: {name} has no gradient"
        want = sum(2 * g[name] for g in per_rank) / ctx.world_size
        assert_close(
            ctx,
            f"gradient of {name} after no_sync() and a synced step (the ranks' mean of twice "
            "their bf16 gradients)",
            grad.float(),
            want,
            BF16_TOLS["grad"],
        )
