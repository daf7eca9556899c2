"""Area "training": the gradient hooks of a ``fully_shard`` unit: the all-reduce hook's stream on a
1-D mesh (P77) and its refusal under native HSDP (P94), and a post-accumulate-grad hook on a
sharded parameter (P103).

[Note: the all-reduce hook's stream]
On a 1-D mesh there is no all-reduce; ``set_all_reduce_hook(hook, stream=s)`` runs the hook after
the reduce-scatter, inside ``s`` (the device module's stream context, which exists on CPU too:
``torch.cpu.current_stream()`` is ``s`` while it runs). On a (replicate, shard) mesh the hook runs
in FSDP's own all-reduce stream, so a stream of the user's is refused (P94).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    assert_sharded_grad,
    make_batch,
    make_optimizer,
    per_sample_loss,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.edges import Pair
from conformance.registry import check


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING, base.HSDP_ALL_REDUCE},
    world_sizes=(1, 2),
)
def all_reduce_hook_stream_1d(ctx):
    """P77: on a 1-D mesh, ``model.out.set_all_reduce_hook(hook, stream=s)`` with ``s`` a fresh
    stream of the device's module (``torch.get_device_module(device).Stream()``): in each of two
    backwards ``hook`` runs once, with ``s`` the current stream while it runs, and the current
    stream is the previous one again after the backward; gradients and values after each SGD
    step equal the unsharded model's (the hook only observes)."""
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    device_module = torch.get_device_module(ctx.device)
    stream = device_module.Stream()
    seen = []
    model.out.set_all_reduce_hook(
        lambda reduced: seen.append(device_module.current_stream() == stream), stream=stream
    )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        seen.clear()
        before = device_module.current_stream()
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        assert seen == [True], (
            f"{ctx.where()} step {step}: the all-reduce hook ran {len(seen)} time(s), on the "
            f"given stream: {seen}; expected once, on the stream passed to set_all_reduce_hook"
        )
        assert device_module.current_stream() == before, (
            f"{ctx.where()} step {step}: the current stream changed across the backward"
        )
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx, f"step {step}: {name} sharded gradient", param, oracle.get_parameter(name).grad
            )
        step_and_compare(ctx, model, oracle, opts, step)


HSDP_SHAPES = {2: (2, 1), 4: (2, 2)}  # (replicate, shard) per world size


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.HSDP, base.HSDP_ALL_REDUCE},
    world_sizes=(2, 4),
)
def all_reduce_hook_stream_hsdp_refused(ctx):
    """P94: on a (replicate, shard) mesh ((2, 1) at world size 2, (2, 2) at 4) the all-reduce hook
    runs in FSDP's own all-reduce stream, so ``unit.set_all_reduce_hook(hook, stream=s)`` with a
    stream ``s`` (``torch.get_device_module(device).Stream()``, also on CPU) raises ValueError
    "stream cannot be set when using native HSDP"."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh(HSDP_SHAPES[ctx.world_size], ("replicate", "shard"))
    ctx.seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
    ns.fully_shard(model, mesh=mesh)
    stream = torch.get_device_module(ctx.device).Stream()
    expect_error(
        ctx,
        "set_all_reduce_hook(hook, stream=s) under HSDP",
        ValueError,
        r"stream cannot be set when using native HSDP",
        lambda: model.set_all_reduce_hook(lambda reduced: None, stream=stream),
    )


@check(area="training", requires={base.FSDP2_API, base.TRAINING, base.DTENSOR_PARAMS})
def post_accumulate_grad_hook_sharded(ctx):
    """P103: a ``register_post_accumulate_grad_hook`` hook on a sharded parameter runs once per
    backward, after FSDP has set the parameter's ``.grad`` to the reduced sharded gradient (a
    DTensor whose local tensor is this rank's chunk of the gradient averaged over the ranks'
    slices)."""
    ws, rank = ctx.world_size, ctx.rank
    ctx.seed(0)
    oracle = Pair().to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model.inp, model.out, model):
        ctx.impl.ns.fully_shard(unit, mesh=ctx.make_mesh((ws,)))
    seen: dict[str, list] = {fqn: [] for fqn, _ in model.named_parameters()}
    for fqn, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, fqn=fqn: seen[fqn].append(
                p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad
            )
        )
    g = torch.Generator().manual_seed(103)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    model(x[rank * B : (rank + 1) * B]).square().mean().backward()
    torch.stack(
        [oracle(x[r * B : (r + 1) * B]).square().mean() for r in range(ws)]
    ).mean().backward()
    for fqn, grads in seen.items():
        assert len(grads) == 1, f"{ctx.where()} {fqn}: hook ran {len(grads)} times, expected 1"
        assert isinstance(grads[0], torch.Tensor), (
            f"{ctx.where()} {fqn}: the hook saw .grad {grads[0]!r}, expected the sharded DTensor"
        )
        assert_close(
            ctx,
            f"{fqn} .grad seen by its post-accumulate-grad hook",
            grads[0],
            chunk_of(oracle.get_parameter(fqn).grad, 0, ws, rank),
            FP32["grad"],
        )
