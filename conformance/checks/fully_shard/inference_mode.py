"""Area "training": ``fully_shard`` units under ``torch.inference_mode()`` (P90).

[Note: inference mode]
``torch.inference_mode()`` is ``no_grad`` plus a promise that the tensors it makes are never
seen by autograd: they carry no version counter, and outside the mode they may not be updated in
place. A unit that unshards inside the mode (its first forward there allocates the unsharded
buffers) must therefore give the unsharded model's output there, every time, and must not leave
state behind that a later forward with grad enabled trips over: the buffers the next unshard
writes into must be ordinary tensors again, so that training after an evaluation pass under
``inference_mode`` (a common loop: evaluate, then go on training) runs and equals the unsharded
model's. Model: ``Sequential(Linear(4, 4), Tanh(), Linear(4, 2))`` with both Linears and the root
units; the oracle is the unsharded model (rank r feeds its own ``B`` samples, the oracle the
global batch for the gradients).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close, assert_sharded_grad
from conformance.registry import check

REQUIRES = {base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING}


def _models(ctx):
    mesh = ctx.make_mesh((ctx.world_size,))
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model[0], model[2], model):
        ctx.impl.ns.fully_shard(unit, mesh=mesh)
    return oracle, model


def _batch(ctx, salt):
    g = torch.Generator().manual_seed(salt)
    return torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)


def _evaluate(ctx, oracle, model, passes):
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for i in range(passes):
        x = _batch(ctx, 60 + i)
        with torch.inference_mode():
            out = model(x[mine])
        with torch.no_grad():
            want = oracle(x[mine])
        assert_close(ctx, f"output of inference-mode forward {i}", out, want, FP32["param"])


@check(
    area="training",
    requires=REQUIRES,
    cases={"evaluate": {"train_after": False}, "evaluate-then-train": {"train_after": True}},
)
def inference_mode_forward(ctx, train_after):
    """P90: two forwards of a ``fully_shard`` model under ``torch.inference_mode()`` each give
    the unsharded model's output; with ``train_after``, two SGD steps after them (forward with
    grad enabled, backward on this rank's samples) give sharded gradients equal to the unsharded
    model's chunks of the global batch's gradient, and the unsharded model's parameters."""
    oracle, model = _models(ctx)
    _evaluate(ctx, oracle, model, 2)
    if not train_after:
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    rank = ctx.rank
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(2):
        x = _batch(ctx, 70 + step)
        model(x[mine]).square().mean().backward()
        oracle(x).square().mean().backward()
        for fqn, param in model.named_parameters():
            what = f"step {step} after inference-mode forwards: {fqn} sharded gradient"
            assert_sharded_grad(ctx, what, param, oracle.get_parameter(fqn).grad)
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
    _evaluate(ctx, oracle, model, 1)
