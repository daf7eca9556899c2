"""Area "fsdp1_runtime": the original parameters' gradients around dtype changes, ``no_sync()``
and ``summon_full_params(with_grads=True)`` (R71-R73, R88).

[Note: gradient views after the unusual steps]
* ``model.to(torch.float64)`` after wrapping, on units whose ``MixedPrecision`` names only
  ``reduce_dtype`` (bf16): the parameters, the computation and the gradients follow the new
  dtype (there is no ``param_dtype`` to keep), while the gradients are still reduced in the
  named ``reduce_dtype``: each gradient is float64 holding bf16 values. A forced full-precision
  unshard (``summon_full_params``) then gives the float64 parameters (R71).
* A parameter whose ``.grad`` the user set to None counts as a zero gradient inside
  ``summon_full_params(with_grads=True)`` (its full gradient zeros, or None) and is None again
  after the exit; the other parameters keep their gradients (R72).
* After a backward inside ``no_sync()`` each rank holds its own unreduced, unsharded gradient,
  which is not a shard: ``summon_full_params(with_grads=True)`` either refuses it with
  AssertionError (upstream, before any collective) or shows that very local gradient (R73).
* ``summon_full_params(with_grads=True)`` on a unit none of whose ranks holds a gradient shows no
  gradient on any original parameter, even one whose ``.grad`` the user assigned while it holds
  no element on its rank (such a gradient carries nothing into the flat gradient) (R88).
The model is ``TwoUnits`` (``inner`` its own unit, the root owning ``head``); each rank feeds its
own samples of one global batch, scaled so the rank average is the oracle's global gradient.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES as FSDP1_REQUIRES
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fsdp1.summon_full_params import TwoUnits, visible
from conformance.checks.fsdp1.training import assert_orig_param_grads
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_RUNTIME, base.TRAINING}
PLAN = [("inner", {}), ("", {})]
B = 2  # samples per rank
BF16_TOL = dict(rtol=3e-2, atol=3e-3)


def _build(ctx, **options):
    """(sharded model with ``use_orig_params=True``, unsharded copy)."""
    ctx.seed(0)
    model = TwoUnits().to(ctx.device)
    oracle = copy.deepcopy(model)
    return ctx.impl.shard(model, ctx, plan=PLAN, use_orig_params=True, **options), oracle


def _batch(ctx, dtype=torch.float32):
    """(global batch, this rank's samples)."""
    x = torch.randn(B * ctx.world_size, 5, generator=torch.Generator().manual_seed(11))
    x = x.to(ctx.device, dtype)
    return x, x[B * ctx.rank : B * (ctx.rank + 1)]


def _loss(out: torch.Tensor, ws: int) -> torch.Tensor:
    return out.square().sum() / (B * ws)


def _grads(ctx, model) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in visible(ctx, model).items()}


# ------------------------------------------------------------------------------ R71
@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.MIXED_PRECISION, base.FSDP1_MODULE_TO},
    world_sizes=(1, 2),
)
def module_to_with_reduce_dtype_only(ctx):
    """R71: ``MixedPrecision(reduce_dtype=bf16)`` alone, ``use_orig_params=True``, then
    ``model.to(torch.float64)`` before the first forward: the forward computes in float64 (float64
    output); after the backward every gradient is float64, equals the unsharded model converted
    alike within bf16 tolerance and holds bf16 values (reduced in bf16: each element unchanged by a
    round trip through bf16); ``summon_full_params`` then shows every full parameter in float64
    with the oracle's values."""
    model, oracle = _build(ctx, mixed_precision=dict(reduce_dtype=torch.bfloat16))
    model.to(torch.float64)
    oracle.to(torch.float64)
    x, mine = _batch(ctx, torch.float64)
    out = model(mine)
    assert out.dtype == torch.float64, f"{ctx.where()} forward output {out.dtype}, expected float64"
    _loss(out, 1).backward()
    _loss(oracle(x), ctx.world_size).backward()
    for name, grad in _grads(ctx, model).items():
        if grad is None:
            continue
        assert grad.dtype == torch.float64, f"{ctx.where()} {name}.grad is {grad.dtype}"
        rounded = grad.to(torch.bfloat16).to(torch.float64)
        assert torch.equal(grad, rounded), (
            f"{ctx.where()} {name}.grad holds values bf16 cannot represent (max change in a bf16 "
            f"round trip {(grad - rounded).abs().max().item():.3g}): not reduced in reduce_dtype"
        )
    assert_orig_param_grads(ctx, model, oracle, "reduce_dtype=bf16, then .to(float64)", BF16_TOL)
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    with FSDP.summon_full_params(model, writeback=False):
        got = visible(ctx, model)
        for name, ref in oracle.named_parameters():
            assert got[name].dtype == torch.float64, (
                f"{ctx.where()} inside summon_full_params: {name} is {got[name].dtype}"
            )
            assert_close(ctx, f"inside summon_full_params: {name}", got[name], ref, FP32["param"])


# ------------------------------------------------------------------------------ R72
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def summon_with_grads_keeps_none(ctx):
    """R72: ``use_orig_params=True``: after a backward every rank sets ``inner.weight.grad = None``;
    inside ``summon_full_params(with_grads=True)`` ``inner.weight.grad`` is None or full zeros and
    every other parameter's ``.grad`` is its full gradient (the unsharded model's); after the exit
    ``inner.weight.grad`` is None again and every other gradient is the one it had before."""
    model, oracle = _build(ctx)
    x, mine = _batch(ctx)
    _loss(model(mine), 1).backward()
    _loss(oracle(x), ctx.world_size).backward()
    visible(ctx, model)["inner.weight"].grad = None
    before = {n: None if g is None else g.clone() for n, g in _grads(ctx, model).items()}
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    with FSDP.summon_full_params(model, with_grads=True):
        got = _grads(ctx, model)
        for name, ref in oracle.named_parameters():
            grad, what = got[name], f"inside summon(with_grads): {name}.grad"
            if name == "inner.weight":
                assert grad is None or torch.count_nonzero(grad) == 0, (
                    f"{ctx.where()} {what} (set to None before) is not None nor zeros"
                )
                continue
            assert grad is not None, f"{ctx.where()} {what} is None"
            assert_close(ctx, what, grad, ref.grad, FP32["grad"])
    after = _grads(ctx, model)
    for name, old in before.items():
        grad = after[name]
        assert (grad is None) == (old is None), (
            f"{ctx.where()} after summon(with_grads): {name}.grad is "
            f"{None if grad is None else tuple(grad.shape)}, before it was "
            f"{None if old is None else tuple(old.shape)}"
        )
        if old is not None:
            assert_close(ctx, f"after summon(with_grads): {name}.grad", grad, old, FP32["grad"])


# ------------------------------------------------------------------------------ R73
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(2,))
def summon_with_grads_after_no_sync(ctx):
    """R73: FULL_SHARD at world size 2, ``use_orig_params=True``: after a backward inside
    ``model.no_sync()``, ``summon_full_params(with_grads=True)`` is either refused with
    AssertionError (upstream: the accumulated gradient is unsharded, not the rank's shard) or
    shows every parameter's full gradient as this rank's own, unreduced one (the unsharded model's
    on this rank's samples); never any other error."""
    model, oracle = _build(ctx)
    _, mine = _batch(ctx)
    with model.no_sync():
        _loss(model(mine), 1).backward()
    _loss(oracle(mine), 1).backward()
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    try:
        with FSDP.summon_full_params(model, with_grads=True):
            got = {n: None if g is None else g.clone() for n, g in _grads(ctx, model).items()}
    except AssertionError:
        return
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} summon(with_grads) after a no_sync backward raised "
            f"{type(exc).__name__}: {str(exc)[:300]}; expected AssertionError or the local "
            "gradients"
        ) from exc
    for name, ref in oracle.named_parameters():
        grad, what = got[name], f"summon(with_grads) after no_sync: {name}.grad"
        assert grad is not None, f"{ctx.where()} {what} is None"
        assert_close(ctx, what, grad, ref.grad, FP32["grad"])


# ------------------------------------------------------------------------------ R88
@check(area="fsdp1_runtime", requires=FSDP1_REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(2,))
def summon_with_grads_none_anywhere(ctx):
    """R88: ``use_orig_params=True``, FULL_SHARD, one unit over ``Sequential(Linear(4, 4,
    bias=False), Linear(4, 4, bias=False))`` (rank 0's shard holds ``0.weight``, rank 1's
    ``1.weight``), before any backward: rank 0 sets ``1.weight.grad`` to an empty tensor of its
    (empty) local shape; inside ``summon_full_params(with_grads=True)`` every original
    parameter's ``.grad`` is None on every rank (no rank's unit holds a gradient)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model = ctx.impl.shard(plain.to(ctx.device), ctx, use_orig_params=True)
    inner = model.module
    if ctx.rank == 0:
        p = inner[1].weight
        assert p.numel() == 0, (
            f"{ctx.where()} test setup: 1.weight holds {p.numel()} elements on rank 0, expected 0"
        )
        p.grad = torch.zeros_like(p)
    with fsdp.summon_full_params(model, with_grads=True):
        held = {n: tuple(p.grad.shape) for n, p in inner.named_parameters() if p.grad is not None}
    assert not held, (
        f"{ctx.where()} summon_full_params(with_grads=True) with no gradient on any rank's unit: "
        f"gradients {held}, expected every .grad None"
    )
