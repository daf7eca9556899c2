"""Area "training": gradient accumulation without sync under mixed precision (P20).

[Note: accumulation without sync]
After ``set_requires_gradient_sync(False)`` a backward reduces nothing: every rank keeps its own
unsharded gradient and sums the next backwards into it; the first synced backward reduce-scatters
the sum, so the sharded gradient is the oracle's chunk of the gradient summed over the
micro-batches' global batches (each a mean over ``ws * B`` samples). With a ``reduce_dtype`` that
differs from the compute dtype (``param_dtype=bf16, reduce_dtype=fp32``) the kept gradient is moved
to ``reduce_dtype`` and accumulated there; with no ``reduce_dtype``, or one equal to the
parameters' dtype, it stays the unsharded parameter's ``.grad`` (visible when the unit does not
reshard after backward: ``set_reshard_after_backward(False)`` keeps the unsharded parameters
registered). A frozen parameter (``requires_grad=False``) of the same unit has no gradient at any
point and does not disturb the others.

The oracle is ``_shared/oracle.py``'s: the unsharded model fed the global batch (each micro-batch's
loss a mean, backwards summed into ``.grad``), plus, for the unreduced gradients, a second copy fed
only this rank's ``B`` samples.
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    make_batch,
    per_sample_loss,
    shard_dim,
)
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

MICRO = 3  # micro-batches per step; all but the last without gradient sync
FROZEN = "inp.bias"
# case -> (mixed-precision options, tolerance of the reduced gradient against the fp32 oracle)
MP_CASES = {
    # reduce_dtype differs from param_dtype: the kept gradient is upcast and accumulated in fp32
    "bf16-fp32-reduce": (
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        dict(rtol=3e-2, atol=3e-3),
    ),
    # reduce_dtype equal to the parameters' own dtype: nothing to move
    "fp32-reduce": ({"reduce_dtype": torch.float32}, FP32["grad"]),
    "no-policy": (None, FP32["grad"]),
}
REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API}


def _models(ctx, mp):
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    oracle.get_parameter(FROZEN).requires_grad_(False)
    local = copy.deepcopy(oracle)  # fed this rank's samples only: the unreduced gradient
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=PLANS["nested"], **({"mixed_precision": mp} if mp else {})
    )
    return model, oracle, local


def _micro_batch(ctx, model, oracle, local, micro):
    x, y = make_batch("mlp", ctx.world_size, micro, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    model.set_requires_gradient_sync(micro == MICRO - 1)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    per_sample_loss("mlp", oracle(x), y).mean().backward()
    per_sample_loss("mlp", local(x[mine]), y[mine]).mean().backward()


def _assert_reduced(ctx, model, oracle, tol, what):
    """Every trainable parameter's sharded gradient is the oracle's chunk; the frozen one has none."""
    for name, param in model.named_parameters():
        if name == FROZEN:
            assert param.grad is None, (
                f"{ctx.where()} frozen {name}: has a gradient {what}, expected None"
            )
            continue
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient {what}"
        assert param.grad.dtype == param.dtype, (
            f"{ctx.where()} {name}: sharded gradient {param.grad.dtype}, expected the sharded "
            f"parameter's {param.dtype}"
        )
        expected = chunk_of(
            oracle.get_parameter(name).grad, shard_dim(param), ctx.world_size, ctx.rank
        )
        assert_close(ctx, f"{name} sharded gradient {what}", param.grad.to_local(), expected, tol)


@check(
    area="training",
    requires=REQUIRES | {base.MIXED_PRECISION},
    cases={case: {"case": case} for case in MP_CASES},
)
def grad_accumulation_no_sync_mixed_precision(ctx, case):
    """P20: three micro-batches, the first two with ``set_requires_gradient_sync(False)``, under
    ``MixedPrecisionPolicy`` (``case``): after the no-sync backwards no parameter has a sharded
    gradient; after the synced one each trainable parameter's sharded gradient (in its own dtype)
    is the oracle's chunk of the gradient summed over the three global batches (bf16 compute within
    rtol 3e-2 / atol 3e-3, fp32 within the oracle's fp32 tolerance), and the frozen ``inp.bias``
    has none."""
    mp, tol = MP_CASES[case]
    model, oracle, local = _models(ctx, mp)
    for micro in range(MICRO):
        _micro_batch(ctx, model, oracle, local, micro)
        if micro < MICRO - 1:
            for name, param in model.named_parameters():
                assert param.grad is None, (
                    f"{ctx.where()} {name}: sharded gradient after no-sync micro-batch {micro}, "
                    f"expected None until a synced backward"
                )
    _assert_reduced(ctx, model, oracle, tol, f"after {MICRO} micro-batches ({case})")


@check(
    area="training",
    requires=REQUIRES | {base.MIXED_PRECISION},
    cases={case: {"case": case} for case in ("fp32-reduce", "no-policy")},
)
def no_sync_grad_stays_on_unsharded_param(ctx, case):
    """P20: with no ``reduce_dtype`` or one equal to the parameters' dtype, and
    ``set_reshard_after_backward(False)``, each no-sync backward leaves every trainable unsharded
    parameter's ``.grad`` equal to this rank's own (unreduced) gradient summed over the
    micro-batches so far, and the frozen one's ``.grad`` None; after the synced backward and
    ``reshard()`` the sharded gradients are the oracle's chunks of the summed global gradient."""
    mp, tol = MP_CASES[case]
    model, oracle, local = _models(ctx, mp)
    model.set_reshard_after_backward(False)
    for micro in range(MICRO - 1):
        _micro_batch(ctx, model, oracle, local, micro)
        for name, param in model.named_parameters():
            what = f"{name} after no-sync micro-batch {micro} ({case})"
            expected = local.get_parameter(name).grad
            if expected is None:
                assert param.grad is None, f"{ctx.where()} frozen {what}: has a gradient"
                continue
            assert param.grad is not None, (
                f"{ctx.where()} {what}: the unsharded parameter has no .grad, expected this "
                f"rank's unreduced gradient"
            )
            assert_close(ctx, f"unsharded .grad of {what}", param.grad, expected, tol)
    _micro_batch(ctx, model, oracle, local, MICRO - 1)
    for module in model.modules():
        if isinstance(module, ctx.impl.ns.FSDPModule):
            module.reshard()
    _assert_reduced(ctx, model, oracle, tol, f"after the synced backward and reshard() ({case})")


@check(area="training", requires=REQUIRES | {base.MIXED_PRECISION}, world_sizes=(1, 2))
def no_sync_accumulates_in_reduce_dtype(ctx):
    """P20: under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` the gradients of
    ``set_requires_gradient_sync(False)`` micro-batches are accumulated in fp32: a ``fully_shard``
    Linear(4, 1, bias=False), every rank fed ``full((1, 4), 1.0)`` without sync, then
    ``full((1, 4), 2^-8)`` synced (loss ``out.sum()``; each bf16 gradient exact): the sharded
    gradient equals the unsharded fp32 model's mean gradient summed over both, exactly
    1 + 2^-8 (a bf16 accumulation would round it to 1)."""
    ctx.seed(0)
    model = torch.nn.Linear(4, 1, bias=False).to(ctx.device)
    oracle = copy.deepcopy(model)
    policy = ctx.impl.ns.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    for micro, value in enumerate((1.0, 2.0**-8)):
        x = torch.full((1, 4), value, device=ctx.device)
        model.set_requires_gradient_sync(micro == 1)
        model(x).float().sum().backward()
        (oracle(x.repeat(ctx.world_size, 1)).sum() / ctx.world_size).backward()
    expected = oracle.weight.grad.cpu()
    assert torch.equal(expected, torch.full((1, 4), 1.0 + 2.0**-8)), "oracle: not 1 + 2^-8"
    grad = model.weight.grad
    assert grad is not None and grad.dtype == torch.float32, (
        f"{ctx.where()} sharded gradient {None if grad is None else grad.dtype}, expected float32"
    )
    full = grad.full_tensor().cpu()
    assert torch.equal(full, expected), (
        f"{ctx.where()} gradient summed over a no-sync and a synced micro-batch is "
        f"{full.flatten().tolist()}, expected exactly 1 + 2^-8 = {1.0 + 2.0**-8} (accumulated in "
        f"the reduce dtype fp32, not in bf16)"
    )
