"""Area "states": a unit's post-backward runs as soon as backward leaves the unit (P23).

[Note: when post-backward runs]
FSDP2 routes the tensors a unit's forward receives (those that require grad) through an identity
whose backward is the unit's post-backward: once autograd has computed the gradient of the unit's
inputs, the unit's parameters are resharded (``reshard_after_backward``, default True) and its
gradients reduce-scattered into the sharded parameters' ``.grad``, before backward goes on into the
units that ran earlier in forward. The root's final callback only catches up units whose inputs
needed no gradient. So a tensor hook on the input of a later unit (which fires right after that
gradient is ready, inside backward) already sees the later unit SHARDED with its sharded ``.grad``
equal to the oracle's chunk. The final values alone cannot tell: a post-backward deferred to the
final callback gives the same gradients. The inputs routed are every grad-requiring tensor in the
unit's ``args`` / ``kwargs``, looked for inside tuples, lists, dicts and dataclass instances: a
unit whose only such tensor is a field of a dataclass argument is no exception.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

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

REQUIRES = {base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING}


class HookedMLP(MLP):
    """``MLP`` whose forward calls ``on_grad`` (if set) from a hook on the input of ``out``."""

    on_grad = None

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.on_grad is not None and h.requires_grad:
            h.register_hook(self.on_grad)
        return self.out(h)


@dataclass
class Carry:
    """A dataclass forward argument: one tensor field and one plain field."""

    h: torch.Tensor
    tag: str


class CarryLinear(nn.Linear):
    """``nn.Linear`` that takes a ``Carry`` and applies itself to its ``h``."""

    def forward(self, carry):
        assert carry.tag == "t", f"Carry.tag {carry.tag!r} was not passed through"
        return super().forward(carry.h)


class CarryMLP(HookedMLP):
    """``HookedMLP`` whose ``out`` takes ``Carry(h, "t")``: ``h`` is its only grad-requiring input."""

    def __init__(self):
        super().__init__()
        self.out = CarryLinear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.on_grad is not None and h.requires_grad:
            h.register_hook(self.on_grad)
        return self.out(Carry(h, "t"))


def _assert_out_done_inside_backward(ctx, plain, what):
    """Shard ``plain`` (units inp, out, root), run one backward and assert that the hook on
    ``out``'s input saw ``out`` SHARDED with the oracle's chunk as its sharded ``.grad``."""
    from torch.distributed.tensor import DTensor

    oracle = copy.deepcopy(plain)
    model = ctx.impl.shard(plain, ctx, plan=PLANS["nested"])
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    per_sample_loss("mlp", oracle(x), y).mean().backward()
    seen = {}

    def record(grad):
        for name in ("weight", "bias"):
            param = model.out.get_parameter(name)
            sharded = isinstance(param, DTensor)
            seen[name] = (
                sharded,
                param.grad.to_local().clone() if sharded and param.grad is not None else None,
            )
        return grad

    model.on_grad = record
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    assert set(seen) == {"weight", "bias"}, (
        f"{ctx.where()} {what}: the hook on out's input gradient did not run in backward"
    )
    for name, (sharded, grad) in seen.items():
        fqn = f"out.{name}"
        assert sharded, (
            f"{ctx.where()} {what}: {fqn} UNSHARDED (a plain tensor) when backward had left unit "
            f"'out'; its post-backward should have resharded it then"
        )
        assert grad is not None, (
            f"{ctx.where()} {what}: {fqn} has no sharded .grad when backward had left unit "
            f"'out'; its post-backward should have reduce-scattered it then"
        )
        ograd = oracle.get_parameter(fqn).grad
        expected = chunk_of(ograd, shard_dim(model.get_parameter(fqn)), ctx.world_size, ctx.rank)
        assert_close(
            ctx, f"{what}: {fqn} sharded grad seen inside backward", grad, expected, FP32["grad"]
        )


@check(area="states", requires=REQUIRES)
def post_backward_when_backward_leaves_unit(ctx):
    """P23: with units ``inp``, ``out`` and the root, a hook on the gradient of ``out``'s input
    (inside backward, before ``inp``'s backward) sees ``out.weight`` and ``out.bias`` registered as
    SHARDED DTensors whose ``.grad`` is already the oracle's chunk."""
    ctx.seed(0)
    _assert_out_done_inside_backward(ctx, HookedMLP().to(ctx.device), "tensor input")


@check(area="states", requires=REQUIRES)
def post_backward_when_backward_leaves_unit_dataclass_input(ctx):
    """P23: as ``post_backward_when_backward_leaves_unit``, but ``out`` is called with a dataclass
    ``Carry(h, "t")`` whose field ``h`` is its only grad-requiring input: the hook on ``h``'s
    gradient still sees ``out.weight`` and ``out.bias`` SHARDED with the oracle's chunk as
    ``.grad`` (and ``out`` receives the ``tag`` field unchanged)."""
    ctx.seed(0)
    _assert_out_done_inside_backward(ctx, CarryMLP().to(ctx.device), "dataclass input")
