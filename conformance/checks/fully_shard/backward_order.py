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
final callback gives the same gradients.
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


class HookedMLP(MLP):
    """``MLP`` whose forward calls ``on_grad`` (if set) from a hook on the input of ``out``."""

    on_grad = None

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.on_grad is not None and h.requires_grad:
            h.register_hook(self.on_grad)
        return self.out(h)


@check(area="states", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def post_backward_when_backward_leaves_unit(ctx):
    """P23: with units ``inp``, ``out`` and the root, a hook on the gradient of ``out``'s input
    (inside backward, before ``inp``'s backward) sees ``out.weight`` and ``out.bias`` registered as
    SHARDED DTensors whose ``.grad`` is already the oracle's chunk."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    plain = HookedMLP().to(ctx.device)
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
        f"{ctx.where()} the hook on out's input gradient did not run in backward"
    )
    for name, (sharded, grad) in seen.items():
        fqn = f"out.{name}"
        assert sharded, (
            f"{ctx.where()} {fqn}: UNSHARDED (a plain tensor) when backward had left unit 'out'; "
            f"its post-backward should have resharded it then"
        )
        assert grad is not None, (
            f"{ctx.where()} {fqn}: no sharded .grad when backward had left unit 'out'; its "
            f"post-backward should have reduce-scattered it then"
        )
        ograd = oracle.get_parameter(fqn).grad
        expected = chunk_of(ograd, shard_dim(model.get_parameter(fqn)), ctx.world_size, ctx.rank)
        assert_close(ctx, f"{fqn} sharded grad seen inside backward", grad, expected, FP32["grad"])
