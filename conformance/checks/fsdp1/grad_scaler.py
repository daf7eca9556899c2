"""Area "fsdp1_runtime": FSDP1's ``ShardedGradScaler`` (R28).

[Note: a scaler over shards]
A GradScaler multiplies the loss by its scale S, divides every gradient by S before the step
(``unscale_``) and records whether any gradient held an inf or nan. Over FSDP1 each rank holds
only its shard of a gradient, so the record is all-reduced over the ranks: a non-finite value in
any rank's shard makes *every* rank skip ``optimizer.step()`` and multiply S by
``backoff_factor`` in ``update()``; after ``growth_interval`` finite steps in a row S is
multiplied by ``growth_factor``. The oracle is the rule itself: the unsharded model stepped with
the unscaled gradient on a finite step and not stepped on a skipped one, and S as computed above.
"""

from __future__ import annotations

import copy
import importlib

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, Scale, full_params
from conformance.registry import check

B = 2
INIT, GROWTH, BACKOFF = 2.0**4, 2.0, 0.5


FP16_TOL = dict(rtol=1e-2, atol=2e-3)  # fp16 compute, fp16 gradients (one rounding each)
# model -> (class, input / output features, wrap plan)
MODELS = {
    "inner_head": (InnerHeadNet, 4, 3, [("inner", {}), ("", {})]),
    "scale": (Scale, 3, 3, None),  # one element: at ws 2 rank 1 holds only padding
}


def _batch(ctx, step, d_in, d_out):
    g = torch.Generator().manual_seed(950 + step)
    x = torch.randn(ctx.world_size * B, d_in, generator=g)
    return x.to(ctx.device), torch.randn(ctx.world_size * B, d_out, generator=g).to(ctx.device)


def _poison_rank(ctx, model) -> int:
    """The last rank holding a non-empty gradient (every rank learns it)."""
    import torch.distributed as dist

    has = any(p.grad is not None and p.grad.numel() for p in model.parameters())
    flags = [has] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(flags, has)
    return max(r for r, f in enumerate(flags) if f)


@check(
    area="fsdp1_runtime",
    requires={base.TRAINING, base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_GRAD_SCALER},
    cases={
        "flat": {"orig": False},
        "orig_params": {"orig": True},
        # a rank without any gradient (use_orig_params: its views hold no element)
        "orig_params_empty_rank": {"orig": True, "model": "scale"},
        # fp16 gradients (keep_low_precision_grads): unscale_ allows them under FSDP
        "fp16_grads": {"orig": False, "fp16": True},
    },
    world_sizes=(1, 2),
)
def sharded_grad_scaler(ctx, orig, model="inner_head", fp16=False):
    """R28: ``ShardedGradScaler(init_scale=16, growth_factor=2, backoff_factor=0.5,
    growth_interval=1)`` over an FSDP1 model: a finite step unscales the gradients (the step
    equals the unsharded model's SGD step) and doubles the scale; then a non-finite gradient on
    the last rank holding one only makes every rank skip the step (parameters unchanged) and
    halves the scale; a finite step after it steps again. Also where a rank holds no gradient
    at all, and with fp16 gradients (``MixedPrecision(param_dtype=fp16,
    keep_low_precision_grads=True)``, compared with fp16 tolerances)."""
    ns = ctx.impl.ns
    scaler_mod = importlib.import_module(f"{ns.__name__}.sharded_grad_scaler")
    ctx.seed(0)
    cls, d_in, d_out, plan = MODELS[model]
    oracle = cls().to(ctx.device)
    options = {"use_orig_params": orig}
    if fp16:
        options["mixed_precision"] = dict(
            param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True
        )
    tol = FP16_TOL if fp16 else FP32["param"]
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan, **options)
    scaler = scaler_mod.ShardedGradScaler(
        device=ctx.device.type,
        init_scale=INIT,
        growth_factor=GROWTH,
        backoff_factor=BACKOFF,
        growth_interval=1,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    scale = INIT
    for step, poison in enumerate((False, True, False)):
        x, y = _batch(ctx, step, d_in, d_out)
        loss = ((model(x[mine]).float() - y[mine]) ** 2).mean()
        scaled = scaler.scale(loss)
        assert_close(ctx, f"step {step} scaled loss", scaled, loss * scale, FP32["loss"])
        scaled.backward()
        if poison and ctx.rank == _poison_rank(ctx, model):
            grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
            grads[0].view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        oloss = ((oracle(x) - y) ** 2).mean()
        oloss.backward()
        if not poison:
            oopt.step()
        oopt.zero_grad()
        scale = scale * (BACKOFF if poison else GROWTH)
        got_scale = float(scaler.get_scale())
        assert got_scale == scale, (
            f"{ctx.where()} step {step} ({'inf on the last rank' if poison else 'finite'}): "
            f"scale {got_scale} after update(), expected {scale}"
        )
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(
                ctx,
                f"{name} after step {step} ({'skipped on every rank' if poison else 'stepped'})",
                got[name],
                ref,
                tol,
            )
