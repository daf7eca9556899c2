"""Area "fsdp1_runtime": ``clip_grad_norm_`` at the edges of its arguments (R2, R89).

Two survivors of the mutation campaign (``conformance/mutation/triage.toml``) showed what the
main clipping check (``clip_grad_norm.py``, [Note: the clipping oracle]) cannot see:

* the ``1e-6`` in the factor ``max_norm / (total + 1e-6)`` only matters when the total norm is
  itself near ``1e-6``: here the loss is scaled so that the unsharded gradients' norm is exactly
  ``1e-6`` and ``max_norm`` is half of it, so the factor is ``0.25`` (a ``- 1e-6`` would divide by
  zero and clamp to 1);
* ``norm_type`` may be given as the string ``"inf"`` (both upstream FSDP1 and
  ``torch.nn.utils.clip_grad_norm_`` convert it with ``float()``): it must clip exactly as
  ``math.inf`` does.

The expected norm and gradients come from ``torch.nn.utils.clip_grad_norm_`` on the unsharded
gradients reassembled from every rank's shards (the same oracle as the main check).

[Note: max_norm as float() takes it]
``clip_grad_norm_`` on sharded units takes ``max_norm`` as anything ``float()`` accepts (the
string ``"0.5"``), as ``torch.nn.utils.clip_grad_norm_`` does (R89).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from conformance.checks._shared.fsdp1_setup import _global_batch
from conformance.checks._shared.oracle import (
    MODELS,
    PLANS,
    B,
    assert_close,
    make_batch,
    per_sample_loss,
)
from conformance.checks.fsdp1.clip_grad_norm import CLIP, full_grads, oracle_clip
from conformance.registry import check

TINY_NORM = 1e-6
# gradients of size ~1e-7: only relative agreement means anything
REL_TOL = dict(rtol=1e-4, atol=1e-13)

CASES = {
    "norm-near-epsilon": dict(norm=2.0, given=2.0, target=TINY_NORM),
    "inf-as-string": dict(norm=math.inf, given="inf", target=None),
}


@check(area="fsdp1_runtime", requires=CLIP, cases=CASES)
def clip_grad_norm_argument_edges(ctx, norm, given, target):
    """R2: ``clip_grad_norm_`` scales by ``max_norm / (total + 1e-6)`` also when the total norm is
    about ``1e-6`` (factor 0.25 here, not 1), and accepts ``norm_type="inf"`` as ``math.inf``;
    the returned norm and the clipped gradients equal ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded gradients."""
    ctx.seed(0)
    model = MODELS["mlp"]().to(ctx.device)
    oracle = copy.deepcopy(model)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    scale = 1.0
    if target is not None:  # scale the loss so that the oracle's gradient norm is `target`
        probe = copy.deepcopy(oracle)
        per_sample_loss("mlp", probe(x), y).mean().backward()
        unscaled = torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()], norm)
        scale = target / unscaled.item()
    model = ctx.impl.shard(model, ctx, plan=PLANS["nested"])
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    (per_sample_loss("mlp", model(x[mine]), y[mine]).mean() * scale).backward()
    (per_sample_loss("mlp", oracle(x), y).mean() * scale).backward()
    before = full_grads(ctx, model, oracle, use_orig_params=False)
    total = torch.nn.utils.get_total_norm([p.grad for p in oracle.parameters()], norm).item()
    max_norm = 0.5 * total
    want_norm, want = oracle_clip(before, max_norm, norm)
    got_norm = model.clip_grad_norm_(max_norm, given)
    where = f"max_norm={max_norm:.4g} norm_type={given!r} (total norm {total:.4g})"
    assert_close(ctx, f"{where}: returned total norm", got_norm.reshape(()), want_norm, REL_TOL)
    after = full_grads(ctx, model, oracle, use_orig_params=False)
    for name in want:
        assert_close(
            ctx,
            f"{where}: {name} gradient after clipping (vs the oracle)",
            after[name],
            want[name],
            REL_TOL,
        )


# ------------------------------------------------------------------------------ R89
@check(area="fsdp1_runtime", requires=CLIP, world_sizes=(2,))
def clip_grad_max_norm_as_string(ctx):
    """R89: FULL_SHARD at ws 2, one unit over ``Sequential(Linear(4, 8), Linear(8, 4))``, a
    backward on rank r's samples: ``clip_grad_norm_("0.5")`` returns the total norm and leaves the
    gradients that ``torch.nn.utils.clip_grad_norm_(grads, 0.5)`` gives on the unsharded
    model's gradients (reassembled from every rank's shards)."""
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx)
    x = _global_batch(ctx, 89) * 4  # gradients well above the max_norm
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    model(x[mine]).square().sum(dim=1).mean().backward()
    oracle(x).square().sum(dim=1).mean().backward()
    before = full_grads(ctx, model, oracle, use_orig_params=False)
    want_norm, want = oracle_clip(before, 0.5, 2.0)
    assert want_norm.item() > 0.5, f"{ctx.where()} test setup: total norm {want_norm.item()}"
    got_norm = model.clip_grad_norm_("0.5")
    assert_close(
        ctx, 'clip_grad_norm_("0.5"): total norm', got_norm.reshape(()), want_norm, REL_TOL
    )
    after = full_grads(ctx, model, oracle, use_orig_params=False)
    for name in want:
        assert_close(
            ctx, f'clip_grad_norm_("0.5"): {name} gradient', after[name], want[name], REL_TOL
        )
