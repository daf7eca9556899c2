"""Area "training", FSDP1 with modules that read a wrapped child's parameters without calling it.

[Note: a parent reading a wrapped child's parameter]
``nn.MultiheadAttention`` passes ``out_proj.weight`` and ``out_proj.bias`` to a functional call; it
never calls ``out_proj``. With every module its own unit (``attn.out_proj``, then ``attn``, then
the root: what ``always_wrap_policy`` builds), FSDP1 must still train the model as the
single-process oracle of ``_shared/oracle.py`` does (every rank feeds the oracle the whole global
batch and the wrapped model its own ``B`` samples): rank r's loss equals the oracle's loss on rank
r's samples, and after each optimizer step every parameter (reassembled from the flat shards)
equals the oracle's.
Upstream torch 2.13 trains it only at world size 1 with ``use_orig_params=True``, where the
original parameters are full-shape views into the unsharded flat parameter between forwards.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close, make_optimizer
from conformance.checks.fsdp1.training import assert_params_equal_oracle
from conformance.registry import check

EMBED, HEADS, SEQ = 8, 2, 3
STEPS = 2
# every module its own unit, children first (always_wrap_policy's units)
ALWAYS_WRAP = [("attn.out_proj", {}), ("attn", {}), ("", {})]


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention(8, 2)`` used as self-attention on (batch, 3, 8) inputs."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _batch(ws: int, step: int, device) -> torch.Tensor:
    """The global batch of step ``step``: ws*B samples, the same on every rank."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(ws * B, SEQ, EMBED, generator=g).to(device)


@check(
    area="training",
    requires={base.TRAINING, base.FLAT_PARAM, base.AUTO_WRAP},
    cases={"flat": {"use_orig_params": False}, "orig-params": {"use_orig_params": True}},
)
def flat_parent_reads_child_param(ctx, use_orig_params):
    """FSDP1 with every module wrapped trains ``nn.MultiheadAttention``, which reads its wrapped
    ``out_proj``'s weight and bias without calling it: losses and parameters after each SGD step
    equal the single-process oracle's (P6, S17)."""
    ctx.seed(0)
    model = SelfAttention().to(ctx.device)
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, plan=ALWAYS_WRAP, use_orig_params=use_orig_params)
    opt, oopt = (
        make_optimizer("sgd", model.parameters()),
        make_optimizer("sgd", oracle.parameters()),
    )
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(STEPS):
        x = _batch(ctx.world_size, step, ctx.device)
        loss = model(x[mine]).pow(2).mean()
        loss.backward()
        oloss = oracle(x).pow(2).mean(dim=(1, 2))
        oloss.mean().backward()
        assert_close(ctx, f"step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
        assert_params_equal_oracle(ctx, model, oracle, f"after step {step}")
