"""Area "mixed_precision", FSDP1 ``MixedPrecision`` rules that the training checks do not reach.

[Note: keep_low_precision_grads where FSDP does not shard]
At world size 1 FSDP1 runs NO_SHARD: the gradient is all-reduced in place, never reduce-scattered,
and with ``keep_low_precision_grads=True`` it is never cast back. So after backward the flat
gradient, and with ``use_orig_params=True`` every original parameter's ``.grad``, is in the
reduce dtype (``reduce_dtype``, or ``param_dtype`` when that is None), while the parameters stay
fp32 (R6). The values are the single-process oracle's gradients (one bf16 rounding; fp16 is finer).

[Note: buffer_dtype per unit]
Lazy init (the root's first forward, before any unit's own forward) casts the floating buffers
of every unit to that unit's own ``MixedPrecision.buffer_dtype``; a unit without one (no mixed precision, or ``buffer_dtype=None``)
keeps fp32 buffers and does not stop the later units from being cast (R7). Values are unchanged
(the cast of 0.5 and 1.0 is exact).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import MODELS, B, assert_close, make_batch, per_sample_loss
from conformance.checks.fsdp1.training import BF16_TOLS, assert_flat_grads, flat_grads
from conformance.registry import check

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LOW_CASES = {
    f"{orig}-reduce-{name}": {"orig": orig == "orig-params", "reduce": dtype}
    for orig in ("flat", "orig-params")
    for name, dtype in (("none", None), ("fp16", FP16), ("fp32", FP32))
}


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.TRAINING},
    cases=LOW_CASES,
    world_sizes=(1,),
)
def flat_keep_low_precision_grads_no_shard(ctx, orig, reduce):
    """R6: at world size 1 (NO_SHARD) ``MixedPrecision(param_dtype=bf16, reduce_dtype=...,
    keep_low_precision_grads=True)`` leaves the flat gradient, and with ``use_orig_params=True``
    every parameter's ``.grad``, in ``reduce_dtype or param_dtype`` with the oracle's values; the
    flat parameter stays fp32."""
    want = reduce or BF16
    model, oracle = _one_low_precision_backward(ctx, reduce, orig)
    for fqns, grad in flat_grads(ctx, model):
        assert grad is not None and grad.dtype == want, (
            f"{ctx.where()} flat gradient of {fqns}: dtype {None if grad is None else grad.dtype}, "
            f"expected {want} (keep_low_precision_grads, reduce_dtype={reduce})"
        )
    if not orig:  # with use_orig_params=True the flat layout holds alignment padding
        assert_flat_grads(ctx, model, oracle, "after backward", BF16_TOLS["grad"])
    for fqns, flat in ctx.impl.flat_shards(model):
        assert flat.dtype == FP32, f"{ctx.where()} flat parameter of {fqns} is {flat.dtype}"
    if orig:
        grads = {ctx.impl.clean_fqn(n): p.grad for n, p in model.named_parameters()}
        for name, ref in oracle.named_parameters():
            grad = grads.get(name)
            assert grad is not None and grad.dtype == want, (
                f"{ctx.where()} {name}.grad: {None if grad is None else grad.dtype}, expected "
                f"{want} (keep_low_precision_grads with use_orig_params=True)"
            )
            assert_close(ctx, f"{name}.grad", grad, ref.grad, BF16_TOLS["grad"])


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.TRAINING},
    cases={"reduce-none": {"reduce": None}, "reduce-fp32": {"reduce": FP32}},
    min_world_size=2,
)
def orig_params_keep_low_precision_grads(ctx, reduce):
    """R6: with sharded units, ``use_orig_params=True`` and ``MixedPrecision(param_dtype=bf16,
    keep_low_precision_grads=True)``, after one backward every original parameter with elements
    on this rank has a bf16 ``.grad`` holding the oracle's gradient at the parameter's offset
    (bf16 tolerance), a parameter without elements here has none, and the parameters stay
    fp32."""
    model, oracle = _one_low_precision_backward(ctx, reduce, orig=True)
    views = ctx.impl.local_shards(model)
    params = {ctx.impl.clean_fqn(n): p for n, p in model.named_parameters()}
    for name, ref in oracle.named_parameters():
        view, param = views[name], params[name]
        assert param.dtype == FP32, f"{ctx.where()} {name} is {param.dtype}, expected fp32"
        n = view.local.numel()
        if n == 0:
            assert param.grad is None or param.grad.numel() == 0, (
                f"{ctx.where()} {name} has no element here but a gradient of "
                f"{param.grad.numel()} elements"
            )
            continue
        grad = param.grad
        assert grad is not None and grad.dtype == BF16, (
            f"{ctx.where()} {name}.grad: {None if grad is None else grad.dtype}, expected "
            "bfloat16 (keep_low_precision_grads)"
        )
        expected = ref.grad.detach().reshape(-1)[view.offset : view.offset + n]
        assert_close(ctx, f"{name}.grad", grad.reshape(-1), expected, BF16_TOLS["grad"])


class Stage(nn.Module):
    """Linear(3, 3) plus a floating buffer ``shift`` (0.5s) and an int64 buffer ``count``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("shift", torch.full((3,), 0.5))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        y = self.lin(x.to(self.lin.weight.dtype))
        return y + self.shift.to(y.dtype)


class TwoStages(nn.Module):
    """``first`` then ``second``; records the dtype of ``second``'s buffer as its forward starts
    (before ``second`` itself runs)."""

    def __init__(self):
        super().__init__()
        self.first = Stage()
        self.second = Stage()
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(self.second.shift.dtype)
        return self.second(self.first(x))


BUFFER_CASES = {
    "first-without-mp": {"first": None},
    "first-without-buffer-dtype": {"first": {"param_dtype": BF16}},
}


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.AUTO_WRAP, base.FSDP1_API},
    cases=BUFFER_CASES,
)
def flat_buffer_dtype_per_unit(ctx, first):
    """R7: with ``first`` wrapped without a buffer dtype (no mixed precision, or one without
    ``buffer_dtype``) before ``second`` wrapped with ``MixedPrecision(buffer_dtype=bf16)``,
    ``second``'s buffer is bf16 already when the root's forward starts (lazy init casts every
    unit), and the first forward leaves ``first``'s floating buffer fp32 and ``second``'s bf16, with the values
    they had (integer buffers stay int64)."""
    ctx.seed(0)
    mp = ctx.impl.ns.MixedPrecision
    plan = [
        ("first", {} if first is None else {"mixed_precision": mp(**first)}),
        ("second", {"mixed_precision": mp(buffer_dtype=BF16)}),
        ("", {}),
    ]
    model = ctx.impl.shard(TwoStages().to(ctx.device), ctx, plan=plan)
    with torch.no_grad():
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(ctx.device))
    root = model.module if hasattr(model, "module") else model
    assert root.seen == [BF16], (
        f"{ctx.where()} as the root's first forward started, second.shift was {root.seen}, "
        "expected [torch.bfloat16] (lazy init casts every unit's buffers before any unit runs)"
    )
    seen = {ctx.impl.clean_fqn(n): b for n, b in model.named_buffers()}
    for stage, want in (("first", FP32), ("second", BF16)):
        buf = seen[f"{stage}.shift"]
        assert buf.dtype == want, (
            f"{ctx.where()} {stage}.shift after the first forward is {buf.dtype}, expected "
            f"{want} (its unit's buffer_dtype)"
        )
        assert torch.equal(buf.float().cpu(), torch.full((3,), 0.5)), (
            f"{ctx.where()} {stage}.shift is {buf.tolist()}, expected 0.5s"
        )
        count = seen[f"{stage}.count"]
        assert count.dtype == torch.int64, (
            f"{ctx.where()} {stage}.count is {count.dtype}, expected int64 (not floating)"
        )


class Tail(nn.Module):
    """A plain (never wrapped) module with a floating buffer ``shift`` (0.5s)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.full((3,), 0.5))

    def forward(self, x):
        return x + self.shift.to(x.dtype)


PAST_CHILD_CASES = {
    "child-inherits": {"child": None},
    "child-without-buffer-dtype": {"child": {"param_dtype": None}},
}


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.AUTO_WRAP, base.FSDP1_API},
    cases=PAST_CHILD_CASES,
)
def flat_buffer_dtype_past_wrapped_child(ctx, child):
    """R7: the root with ``MixedPrecision(buffer_dtype=bf16)`` over ``nn.Sequential(unit, tail)``,
    where ``unit`` is wrapped first (inheriting the root's mixed precision, or with one without
    ``buffer_dtype``) and ``tail`` is a plain module: the root's first forward casts ``tail``'s
    floating buffer (which the root owns, and which its buffers list only after the unit's) to
    bf16, and the unit's to its own unit's dtype (bf16, or fp32 without a ``buffer_dtype``)."""
    ctx.seed(0)
    mp = ctx.impl.ns.MixedPrecision
    unit_kwargs = {} if child is None else {"mixed_precision": mp(**child)}
    plan = [("0", unit_kwargs), ("", {"mixed_precision": mp(buffer_dtype=BF16)})]
    model = ctx.impl.shard(nn.Sequential(Stage(), Tail()).to(ctx.device), ctx, plan=plan)
    with torch.no_grad():
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(ctx.device))
    seen = {ctx.impl.clean_fqn(n): b for n, b in model.named_buffers()}
    want = {"0.shift": BF16 if child is None else FP32, "1.shift": BF16}
    for name, dtype in want.items():
        buf = seen[name]
        assert buf.dtype == dtype, (
            f"{ctx.where()} {name} after the first forward is {buf.dtype}, expected {dtype} "
            "(the buffer_dtype of the unit that owns it; 1.shift belongs to the root)"
        )
        assert torch.equal(buf.float().cpu(), torch.full((3,), 0.5)), (
            f"{ctx.where()} {name} is {buf.tolist()}, expected 0.5s"
        )


def _one_low_precision_backward(ctx, reduce, orig: bool):
    """The mlp as one FSDP1 unit with ``MixedPrecision(param_dtype=bf16, reduce_dtype=reduce,
    keep_low_precision_grads=True)`` after one backward of this rank's share of batch 0, and the
    unsharded fp32 oracle after one backward of the whole batch."""
    mp = {"param_dtype": BF16, "reduce_dtype": reduce, "keep_low_precision_grads": True}
    ctx.seed(0)
    model = MODELS["mlp"]().to(ctx.device)
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, mixed_precision=mp, use_orig_params=orig)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    per_sample_loss("mlp", oracle(x), y).mean().backward()
    return model, oracle
