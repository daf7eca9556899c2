"""Area "fsdp1_runtime": ``clip_grad_norm_`` counts the gradients no FSDP unit manages (R2).

[Note: unmanaged gradients in the total norm]
A parameter under the root that no unit flattens (here: one of ``ignored_modules``) still belongs
to the model: the root's ``clip_grad_norm_`` counts its gradient once in the total norm and
scales it by the same factor as every other gradient. FSDP never reduces such a gradient, so the
check feeds every rank the same batch: every rank then holds the single-process model's gradient
of the ignored module, the reduced gradients of the units equal the single-process model's too,
and the oracle is ``torch.nn.utils.clip_grad_norm_`` over all parameters of that model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import assert_close
from conformance.checks.fsdp1.clip_grad_norm import FP32_TOL
from conformance.checks.fsdp1.summon_full_params import ORIG
from conformance.registry import check

CLIP = {base.TRAINING, base.FLAT_PARAM, base.FSDP1_RUNTIME}


class WithIgnored(nn.Module):
    """``inner`` (its own unit) -> tanh -> ``head`` (the root's) -> ``extra`` (ignored)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.extra = nn.Linear(3, 2)

    def forward(self, x):
        return self.extra(self.head(torch.tanh(self.inner(x))))


@check(area="fsdp1_runtime", requires=CLIP, cases=ORIG)
def clip_grad_norm_unmanaged(ctx, orig):
    """R2: with ``ignored_modules=[extra]``, the root's ``clip_grad_norm_(max_norm)`` (max_norm
    half the total) returns the total norm over every gradient, ``extra`` 's included, and scales
    ``extra`` 's gradients by ``max_norm / (total + 1e-6)``: both equal
    ``torch.nn.utils.clip_grad_norm_`` on the single-process model (the same batch everywhere)."""
    ctx.seed(0)
    raw = WithIgnored().to(ctx.device)
    oracle = copy.deepcopy(raw)
    model = ctx.impl.shard(
        raw, ctx, plan=[("inner", {}), ("", {})], use_orig_params=orig, ignored_modules=[raw.extra]
    )
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    model(x).square().sum().backward()
    oracle(x).square().sum().backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in oracle.parameters()], 2.0)
    max_norm = 0.5 * total.item()
    want_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), max_norm, 2.0)
    got_norm = model.clip_grad_norm_(max_norm, 2.0)
    assert_close(
        ctx,
        "total norm with an ignored module's gradients",
        got_norm.reshape(()).float().cpu(),
        want_norm.cpu(),
        FP32_TOL,
    )
    for name in ("weight", "bias"):
        got = getattr(raw.extra, name).grad
        want = getattr(oracle.extra, name).grad
        assert got is not None, f"{ctx.where()} the ignored extra.{name} has no gradient"
        assert_close(ctx, f"ignored extra.{name} gradient after clipping", got, want, FP32_TOL)
