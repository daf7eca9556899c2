"""Area "training": ``set_reduce_scatter_divide_factor``, the deprecated name of
``set_gradient_divide_factor``: it warns and divides the reduced gradients alike (P95).
"""

from __future__ import annotations

import copy
import warnings

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    B,
    assert_close,
    assert_summed_then_divided,
    local_chunk,
    make_batch,
    named_unique,
    own_grads,
    per_sample_loss,
    shard_dim,
)
from conformance.registry import check


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    world_sizes=(2, 4),
)
def reduce_scatter_divide_factor_alias(ctx):
    """P95: ``set_reduce_scatter_divide_factor(f)`` is the deprecated name of
    ``set_gradient_divide_factor(f)``: it warns (DeprecationWarning "Use
    `set_gradient_divide_factor` instead") and the reduced gradients are the SUM of the ranks'
    gradients divided by f (here f = 3.0, an MLP sharded at the root, losses summed), as after ``set_gradient_divide_factor(f)``.
    Reduced with ``set_force_sum_reduction_for_comms(True)`` (a SUM, then the divide), since a
    factor other than the shard size otherwise needs ``ReduceOp.PREMUL_SUM``, which gloo lacks
    (from world size 2, as ``force_sum_with_divide_factor``: at 1 upstream divides twice). At
    world size 2 the gradient is bit-equal to ``(g0 + g1) / 3``, ``g_r`` rank r's gradient of its
    own samples on the unsharded model: 3 is no power of two, so dividing before the sum (force-sum
    ignored) differs in the last bit of some elements."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=None)
    model.set_force_sum_reduction_for_comms(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(3.0)
    said = [f"{w.category.__name__}: {w.message}" for w in caught]
    assert any(
        issubclass(w.category, DeprecationWarning)
        and "set_gradient_divide_factor" in str(w.message)
        for w in caught
    ), f"{ctx.where()} no DeprecationWarning naming set_gradient_divide_factor: {said}"
    x, y = make_batch("mlp", ws, 0, ctx.device)
    mine = slice(rank * B, (rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).sum().backward()
    if ws == 2:  # each rank's own gradient, summed in the one order two addends have, then / 3
        own = own_grads("mlp", oracle, x, y, ws, "sum")
    per_sample_loss("mlp", oracle(x), y).sum().backward()
    for name, param in named_unique(model):
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient after backward"
        dim = shard_dim(param)
        if ws == 2:
            assert_summed_then_divided(ctx, name, param, own, 3.0)
            continue
        assert_close(
            ctx,
            f"gradient of {name} divided by 3.0",
            param.grad.to_local(),
            local_chunk(oracle.get_parameter(name).grad / 3.0, dim, ws, rank),
            FP32["grad"],
        )
