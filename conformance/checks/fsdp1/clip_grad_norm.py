"""Area "fsdp1_runtime": ``FullyShardedDataParallel.clip_grad_norm_`` (R2), also on a tree that
mixes a NO_SHARD unit with a FULL_SHARD root (R56).

[Note: the clipping oracle]
Gradient clipping over a sharded model must give what ``torch.nn.utils.clip_grad_norm_`` gives
on the unsharded gradients: the total norm of all gradients viewed as one vector (p = 2: the root
of the sum of squares over every rank's shards; p = inf: the largest absolute entry on any rank),
and every gradient multiplied by ``min(1, max_norm / (total + 1e-6))``, the same factor on every
rank. The checks here run one training step, then reassemble the full gradients from every rank's
shards *before* clipping (an all-gather in the check, independent of the code under test), apply
``torch.nn.utils.clip_grad_norm_`` to a copy of them (the oracle), call the root's
``clip_grad_norm_`` and reassemble again: the returned norm and the clipped gradients must equal the
oracle's. In fp32 the gradients before clipping must also equal the single-process model's (so the
shards really are the model's gradients), and ``max_norm`` is half that model's norm (clipping
happens) or twice it (the factor is clamped to 1: nothing changes).

Reassembly: with ``use_orig_params=False`` each unit's flat gradient (rank r's padded chunk) is
all-gathered, cut to the unpadded length and split by the unit's parameter sizes in the unit's
order; with ``use_orig_params=True`` each original parameter's 1-D gradient view is placed at its
offset and summed over ranks. The returned norm is a tensor in the gradients' dtype (fp32, or the
low precision dtype with ``keep_low_precision_grads``). On a non-root FSDP module the call raises
``RuntimeError`` saying it should only be called on the root.

On a tree mixing a NO_SHARD unit under a FULL_SHARD root the NO_SHARD gradient counts once;
before any backward the call returns 0 with a UserWarning naming "no gradients" (R56).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings

import torch
import torch.distributed as dist

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    MODELS,
    PLANS,
    B,
    assert_close,
    make_batch,
    per_sample_loss,
)
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.checks.fsdp1.training import flat_grads
from conformance.registry import check

CLIP = {base.TRAINING, base.FLAT_PARAM, base.FSDP1_RUNTIME}
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 compute against the fp32 oracle (gradients before clipping; as training.BF16_TOLS)
BF16_TOL = dict(rtol=3e-2, atol=3e-3)
# bf16 gradients (keep_low_precision_grads) scaled in bf16: one rounding of 2**-8
LOW_TOL = dict(rtol=1e-2, atol=1e-5)


def full_grads(ctx, model, oracle, use_orig_params: bool) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (fp32, on the CPU), reassembled from all ranks' shards."""
    if not use_orig_params:
        out = {}
        for fqns, grad in flat_grads(ctx, model):
            assert grad is not None, f"{ctx.where()} flat parameter of {fqns} has no gradient"
            local = grad.detach().reshape(-1).float().contiguous()
            parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
            dist.all_gather(parts, local)
            flat = torch.cat(parts).cpu()
            sizes = [oracle.get_parameter(f).numel() for f in fqns]
            for fqn, piece in zip(fqns, torch.split(flat[: sum(sizes)], sizes)):
                out[fqn] = piece.reshape(oracle.get_parameter(fqn).shape).clone()
        return out
    views = ctx.impl.local_shards(model)
    grads = {ctx.impl.clean_fqn(n): p.grad for n, p in model.named_parameters()}
    out = {}
    for name, ref in oracle.named_parameters():
        full = torch.zeros(ref.numel(), device=ctx.device)
        view, grad = views[name], grads.get(name)
        n = view.local.numel()
        if n and grad is not None:
            full[view.offset : view.offset + n] = grad.detach().reshape(-1).float()
        dist.all_reduce(full)
        out[name] = full.cpu().reshape(ref.shape)
    return out


def oracle_clip(grads: dict[str, torch.Tensor], max_norm: float, norm_type: float):
    """(total norm, clipped gradients) of ``torch.nn.utils.clip_grad_norm_`` on copies."""
    holders = []
    for g in grads.values():
        holder = torch.nn.Parameter(torch.zeros_like(g))
        holder.grad = g.clone()
        holders.append(holder)
    total = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type)
    return total, {k: h.grad for k, h in zip(grads, holders)}


CASES = {
    "mlp-root-l2-clip": dict(model_name="mlp", plan="root", norm=2.0, factor=0.5),
    "mlp-nested-inf-clip": dict(model_name="mlp", plan="nested", norm=math.inf, factor=0.5),
    "mlp-nested-l2-noclip": dict(model_name="mlp", plan="nested", norm=2.0, factor=2.0),
    # Tiny's ``out`` unit holds 3 elements: ranks past the last chunk hold only padding at ws 4
    "tiny-nested-l2-clip": dict(model_name="tiny", plan="nested", norm=2.0, factor=0.5),
    "tiny-nested-inf-clip": dict(model_name="tiny", plan="nested", norm=math.inf, factor=0.5),
    "mlp-nested-l2-orig": dict(model_name="mlp", plan="nested", norm=2.0, factor=0.5, orig=True),
    "tiny-nested-inf-orig": dict(
        model_name="tiny", plan="nested", norm=math.inf, factor=0.5, orig=True
    ),
    "mlp-nested-l2-bf16": dict(model_name="mlp", plan="nested", norm=2.0, factor=0.5, mp="bf16"),
    "mlp-root-inf-bf16-low": dict(
        model_name="mlp", plan="root", norm=math.inf, factor=0.5, mp="bf16-low"
    ),
    "tiny-nested-l2-bf16-low": dict(
        model_name="tiny", plan="nested", norm=2.0, factor=0.5, mp="bf16-low"
    ),
}
MP = {
    "bf16": {"param_dtype": torch.bfloat16},
    "bf16-low": {"param_dtype": torch.bfloat16, "keep_low_precision_grads": True},
}


@check(area="fsdp1_runtime", requires=CLIP, cases=CASES)
def clip_grad_norm(ctx, model_name, plan, norm, factor, orig=False, mp=None):
    """R2: the root's ``clip_grad_norm_(max_norm, p)`` (p = 2 or inf) returns the total norm of
    all ranks' gradient shards and scales every gradient by ``min(1, max_norm / (total + 1e-6))``:
    the returned norm and the clipped gradients equal ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded gradients (uneven and empty-rank shards, ``use_orig_params``, bf16 mixed precision
    with fp32 or low-precision gradients); on a non-root unit it raises RuntimeError."""
    ctx.seed(0)
    model = MODELS[model_name]().to(ctx.device)
    oracle = copy.deepcopy(model)
    options = {"use_orig_params": orig}
    if mp:
        options["mixed_precision"] = MP[mp]
    model = ctx.impl.shard(model, ctx, plan=PLANS[plan], **options)
    x, y = make_batch(model_name, ctx.world_size, 0, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss(model_name, model(x[mine]), y[mine]).mean().backward()
    per_sample_loss(model_name, oracle(x), y).mean().backward()
    before = full_grads(ctx, model, oracle, orig)
    low = mp == "bf16-low"
    for name, ref in oracle.named_parameters():
        assert_close(
            ctx,
            f"{name} gradient before clipping (vs the oracle)",
            before[name],
            ref.grad,
            BF16_TOL if mp else FP32_TOL,
        )
    tol = LOW_TOL if low else FP32_TOL
    oracle_norm = torch.nn.utils.get_total_norm([p.grad for p in oracle.parameters()], norm)
    max_norm = factor * oracle_norm.item()
    want_norm, want = oracle_clip(before, max_norm, norm)

    if plan == "nested":  # a non-root unit refuses (before any collective)
        inner = model.get_submodule(_inner_unit_name(ctx, model))
        try:
            inner.clip_grad_norm_(max_norm, norm)
        except RuntimeError as exc:
            assert "root" in str(exc), f"{ctx.where()} non-root clip_grad_norm_: {exc}"
        else:
            raise AssertionError(
                f"{ctx.where()} clip_grad_norm_ on a non-root FSDP unit returned; expected "
                "RuntimeError (only the root may clip)"
            )
    want_dtype = _promoted_grad_dtype(ctx, model, orig)
    got_norm = model.clip_grad_norm_(max_norm, norm)
    assert isinstance(got_norm, torch.Tensor) and got_norm.numel() == 1, (
        f"{ctx.where()} clip_grad_norm_ returned {got_norm!r}, expected a scalar tensor"
    )
    assert got_norm.dtype == want_dtype, (
        f"{ctx.where()} returned norm dtype {got_norm.dtype}, expected {want_dtype} (the "
        "promoted dtype of this rank's gradients)"
    )
    where = f"max_norm={max_norm:.4g} norm_type={norm}"
    assert_close(ctx, f"{where}: returned total norm", got_norm.reshape(()), want_norm, tol)
    after = full_grads(ctx, model, oracle, orig)
    for name in want:
        assert_close(
            ctx,
            f"{where}: {name} gradient after clipping (vs the oracle)",
            after[name],
            want[name],
            tol,
        )


def _inner_unit_name(ctx, model) -> str:
    """The module name of a non-root FSDP unit of ``model``."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    names = [n for n, m in model.named_modules() if isinstance(m, fsdp) and n]
    assert names, f"{ctx.where()} the nested plan built no inner FSDP unit"
    return names[0]


def _promoted_grad_dtype(ctx, model, orig: bool) -> torch.dtype:
    """The promoted dtype of this rank's gradients (fp32 when it holds none): the dtype rule of
    the returned norm."""
    if orig:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
    else:
        grads = [g for _, g in flat_grads(ctx, model) if g is not None]
    dtypes = [g.dtype for g in grads] or [torch.float32]
    return functools.reduce(torch.promote_types, dtypes)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_RUNTIME, base.TRAINING},
    world_sizes=(2,),
)
def clip_grad_norm_mixed_strategies(ctx):
    """R56: ``InnerHeadNet`` with ``inner`` a NO_SHARD unit under a FULL_SHARD root: before any
    backward ``root.clip_grad_norm_(1.0)`` returns 0 in fp32 with a UserWarning naming "no
    gradients" and leaves every gradient None; after a backward ``clip_grad_norm_(1e6)`` returns
    the unsharded gradients' 2-norm (the NO_SHARD gradient counted once, nothing clipped),
    ``clip_grad_norm_(0.05, norm_type=inf)`` their largest entry, and an SGD step on the clipped gradients equals the unsharded model's after
    ``torch.nn.utils.clip_grad_norm_(..., 0.05, inf)``."""
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    no_shard = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.NO_SHARD}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", no_shard), ("", {})])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = model.clip_grad_norm_(1.0)
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("no gradients" in t for t in texts), (
        f"{ctx.where()} clip_grad_norm_ without gradients warned {texts}, expected 'no gradients'"
    )
    assert total.dtype == torch.float32 and float(total) == 0.0, (
        f"{ctx.where()} clip_grad_norm_ without gradients returned {total!r}, expected 0 (fp32)"
    )
    assert all(p.grad is None for p in model.parameters()), f"{ctx.where()} a gradient appeared"
    g = torch.Generator().manual_seed(14)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    (model(x[ctx.rank * B : (ctx.rank + 1) * B]) ** 2).sum().div(B).backward()
    (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
    total = model.clip_grad_norm_(1e6)  # the 2-norm, nothing clipped
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e6)
    assert_close(ctx, "2-norm total (the NO_SHARD gradient counted once)", total, ref, FP32["grad"])
    total = model.clip_grad_norm_(0.05, norm_type=math.inf)
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05, norm_type=math.inf)
    assert_close(ctx, "inf-norm total", total, ref, FP32["grad"])
    assert float(ref) > 0.05, f"{ctx.where()} test setup: the gradients need clipping ({ref})"
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.optim.SGD(oracle.parameters(), lr=0.5).step()
    got = full_params(ctx, model)
    for name, p in oracle.named_parameters():
        assert_close(ctx, f"{name} after a clipped step", got[name], p, FP32["param"])
