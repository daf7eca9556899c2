"""Area "lifecycle": ``module.to(dtype)`` once a ``fully_shard`` model has run forward (P9).

[Note: dtype conversion is a before-the-first-forward operation]
``module.to(dtype)`` before any forward converts every sharded parameter and the forward then
computes in that dtype (P9, ``lifecycle::dtype_conversion_*``). After a forward (with or without
backward, with or without ``reshard()``, under ``torch.no_grad()`` too) the sharded parameters are
converted but the next forward fails: the buffers FSDP set up at its lazy init keep the old dtype,
and the all-gather into them raises RuntimeError "Expected out tensor to have dtype double, but got
float instead" (fp32 -> fp64). torch 2.13 and the reference fail the same way, so it is the
contract here: convert before training, or build a fresh sharded model.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.registry import check

MESSAGE = r"Expected out tensor to have dtype double, but got float"


@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS},
    cases={v: {"variant": v} for v in ("forward", "forward-reshard", "forward-backward")},
    world_sizes=(2,),
)
def dtype_conversion_after_forward(ctx, variant):
    """P9: after a forward (``variant``: alone, then ``reshard()``, or with a backward) a
    ``model.to(torch.float64)`` leaves every sharded parameter a float64 DTensor, and the next
    forward raises RuntimeError "Expected out tensor to have dtype double, but got float" on every
    rank; the same model converted before its first forward runs in float64."""
    from torch.distributed.tensor import DTensor

    def build():
        ctx.seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(ctx.device)
        return ctx.impl.shard(model, ctx, plan=[("0", {}), ("2", {}), ("", {})])

    x = torch.randn(2, 4, device=ctx.device)
    fresh = build().to(torch.float64)
    assert fresh(x.double()).dtype == torch.float64, (
        f"{ctx.where()} a model converted before its first forward does not compute in float64"
    )
    model = build()
    out = model(x)
    if variant == "forward-backward":
        out.sum().backward()
    if variant == "forward-reshard":
        model.reshard()
    model.to(torch.float64)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float64, (
            f"{ctx.where()} {name}: {type(param).__name__} {param.dtype} after to(float64), "
            "expected a float64 DTensor"
        )
    try:
        model(x.double())
    except RuntimeError as exc:
        assert re.search(MESSAGE, str(exc)), (
            f"{ctx.where()} forward after to(float64) raised {str(exc)[:200]!r}, expected "
            f"{MESSAGE!r}"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} forward after a forward and to(float64) ran; expected RuntimeError "
            f"{MESSAGE!r} (the lazily initialized buffers keep float32)"
        )
