"""Area "fsdp1_runtime": what the root's lazy initialisation takes of the units under it: units of
mixed ``use_orig_params`` are refused (R97), and a unit that trained as a non-root may be wrapped
again under a new root (R111).

[Note: the units under a root]
The refusal of units with mixed ``use_orig_params`` is pinned as ``init_errors.py``'s [Note:
refusals are contracts] says. A unit that has trained as a non-root may be wrapped again under a
new root, which then trains as the unsharded model (R111).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs, _nested
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.registry import check


# ------------------------------------------------------------------------------ R97
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def mixed_use_orig_params_refused(ctx):
    """R97: a root with ``use_orig_params=False`` over ``Sequential(FSDP(Linear(4, 4),
    use_orig_params=True), Linear(4, 4))``: the first forward raises ValueError "Expects one
    homogeneous value for _use_orig_params" naming both values."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = _nested(ctx, fsdp, {"use_orig_params": True}, {"use_orig_params": False})
    expect_error(
        ctx,
        "first forward of units with use_orig_params True and False",
        ValueError,
        r"Expects one homogeneous value for _use_orig_params but got \{(False, True|True, False)\}",
        lambda: model(_batch(ctx, 97)),
    )


# ------------------------------------------------------------------------------ R111
def _rewrap_step(ctx, model, oracle, opts, salt: int, what: str) -> None:
    """One SGD step of ``model`` on rank r's samples and of ``oracle`` on the global batch; the
    losses agree."""
    g = torch.Generator().manual_seed(salt)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    loss = model(x[mine]).square().mean()
    loss.backward()
    oloss = oracle(x).square().mean(dim=1)
    oloss.mean().backward()
    assert_close(ctx, f"{what}: loss", loss, oloss[mine].mean(), FP32["loss"])
    for opt in opts:
        opt.step()
        opt.zero_grad()


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING})
def trained_unit_under_new_root(ctx):
    """R111: an FSDP1 unit that has trained as a non-root may be wrapped again under a new root:
    ``b = FSDP(Linear(4, 4))``, ``a = FSDP(Sequential(b, Tanh(), Linear(4, 4)))`` trained one
    SGD step, then ``c = FSDP(Sequential(b, Tanh(), Linear(4, 3)))``: one SGD step of ``c``
    gives the unsharded ``Sequential(inner, Tanh(), Linear(4, 3))`` 's loss (``inner`` the
    unsharded copy trained in ``a`` 's step) and afterwards its parameters."""
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    kw = _kwargs(ctx)
    ctx.seed(0)
    inner, head_a, head_c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
    o_inner, o_head_a, o_head_c = (copy.deepcopy(m).to(ctx.device) for m in (inner, head_a, head_c))
    b = FSDP(inner.to(ctx.device), **kw)
    a = FSDP(nn.Sequential(b, nn.Tanh(), head_a.to(ctx.device)), **kw)
    oa = nn.Sequential(o_inner, nn.Tanh(), o_head_a)
    opts = (torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(oa.parameters(), lr=0.1))
    _rewrap_step(ctx, a, oa, opts, 1120, "training step of a")
    c = FSDP(nn.Sequential(b, nn.Tanh(), head_c.to(ctx.device)), **kw)
    oc = nn.Sequential(o_inner, nn.Tanh(), o_head_c)
    opts = (torch.optim.SGD(c.parameters(), lr=0.1), torch.optim.SGD(oc.parameters(), lr=0.1))
    _rewrap_step(ctx, c, oc, opts, 1121, "training step of c (b under a new root)")
    with FSDP.summon_full_params(c):
        got = {ctx.impl.clean_fqn(n): p for n, p in c.named_parameters()}
        for name, ref in oc.named_parameters():
            assert name in got, f"{ctx.where()} after c's step: {name} not visible ({sorted(got)})"
            assert_close(ctx, f"after c's step: {name}", got[name], ref, FP32["param"])
