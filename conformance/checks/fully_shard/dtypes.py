"""Area "bad_input": a unit's trainable parameters share one dtype (P21).

[Note: one dtype per unit]
One reduce-scatter serves all of a unit's gradients, so FSDP2 needs them in one dtype. The first
forward's lazy init checks the parameters that require grad then: two original dtypes among them
raise ``AssertionError`` "FSDP expects uniform original parameter dtype". A frozen parameter of
another dtype passes that check (it has no gradient), and the unit trains; if it is unfrozen later,
its gradient reaches the reduce-scatter next to the others, and that backward raises
``AssertionError`` "FSDP reduce-scatter expects uniform gradient dtype" instead of reducing bytes
of two dtypes as one. Messages are matched on those words only (upstream goes on "but got {...}",
other implementations may word the rest differently).
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values, expect_error
from conformance.registry import check


class TwoDtypes(nn.Module):
    """Linear(4, 6) in fp32, then multiplied by ``scale`` (6,) held in bf16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        with torch.no_grad():  # identical on every rank, no seed needed
            self.lin.weight.copy_(distinct_values((6, 4), 0) / 100.0)
            self.lin.bias.copy_(distinct_values((6,), 1) / 100.0)
        self.scale = nn.Parameter((distinct_values((6,), 2) / 100.0).to(torch.bfloat16))

    def forward(self, x):
        return self.lin(x) * self.scale.float()


def _build(ctx, scale_trainable: bool):
    model = TwoDtypes().to(ctx.device)
    model.scale.requires_grad_(scale_trainable)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    return model


def _step(ctx, model):
    x = distinct_values((2, 4), 3).to(ctx.device) / 10.0
    model(x).sum().backward()


@check(area="bad_input", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def mixed_dtype_trainable_params(ctx):
    """A unit whose trainable parameters are fp32 and bf16 (no mixed precision) fails its first
    forward with AssertionError 'FSDP expects uniform original parameter dtype' (P21)."""
    model = _build(ctx, scale_trainable=True)
    x = distinct_values((2, 4), 3).to(ctx.device) / 10.0
    expect_error(
        ctx,
        "first forward of a unit with fp32 and bf16 trainable parameters",
        AssertionError,
        r"FSDP expects uniform original parameter dtype",
        lambda: model(x),
    )


@check(area="bad_input", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def mixed_dtype_unfrozen_after_init(ctx):
    """A unit of fp32 parameters and a frozen bf16 one trains (its backward gives the fp32
    parameters sharded gradients and the frozen one none); once the bf16 parameter is unfrozen, the
    next backward raises AssertionError 'FSDP reduce-scatter expects uniform gradient dtype' (P21)."""
    model = _build(ctx, scale_trainable=False)
    _step(ctx, model)
    for name, param in model.named_parameters():
        has_grad = param.grad is not None
        assert has_grad == (name != "scale"), (
            f"{ctx.where()} {name}: .grad {'set' if has_grad else 'None'} after a backward with "
            f"'scale' frozen; expected a gradient for every trainable parameter and none for it"
        )
    model.zero_grad()
    model.scale.requires_grad_(True)
    expect_error(
        ctx,
        "backward after unfreezing a bf16 parameter in a unit of fp32 parameters",
        AssertionError,
        r"FSDP reduce-scatter expects uniform gradient dtype",
        lambda: _step(ctx, model),
    )
