"""Area "lifecycle": ``module.to(dtype)`` on a unit holding a zero-numel parameter (P9).

[Note: converting an empty parameter]
``nn.Module._apply`` (``to``, ``double``, ...) replaces every sharded parameter's local tensor; FSDP
re-derives its all-gather source from the new tensor (P9). A zero-numel parameter owns no bytes,
so its old and new storage are equally empty, yet the new tensor has the new dtype: the unsharded
parameter forward computes with must have it too, exactly like the unit's other parameters. The
check converts before the first forward and runs forward only, without grad: torch 2.13 cannot
reduce-scatter a zero-numel gradient (``training::train_parity_zero_numel_param``). Expected values: the same
model converted without FSDP.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import B
from conformance.registry import check


class WithEmpty(nn.Module):
    """Linear(4, 3) plus an empty ``(0, 4)`` parameter added to the output; records the dtype and
    shape of every parameter it computes with."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.seen: list[dict[str, tuple]] = []

    def forward(self, x):
        self.seen.append(
            {
                n: (p.dtype, tuple(p.shape))
                for n, p in (("lin.weight", self.lin.weight), ("empty", self.empty))
            }
        )
        return self.lin(x) + self.empty.sum()


CONVERSIONS = {"to-bfloat16": torch.bfloat16, "to-float64": torch.float64}


@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS},
    cases={k: {"name": k} for k in CONVERSIONS},
)
def dtype_conversion_zero_numel_param(ctx, name):
    """After ``module.to(dtype)`` (bf16, float64) on a sharded unit holding Linear(4, 3) and an
    empty ``(0, 4)`` parameter, both sharded parameters are DTensors of that dtype, forward sees
    every parameter (the empty one included, still ``(0, 4)``) in that dtype, and the output
    equals the unsharded model's converted the same way (P9)."""
    dtype = CONVERSIONS[name]
    ctx.seed(0)
    model = WithEmpty().to(ctx.device)
    oracle = copy.deepcopy(model).to(dtype)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    model.to(dtype)
    for fqn, param in model.named_parameters():
        assert param.dtype == dtype and param.to_local().dtype == dtype, (
            f"{ctx.where()} {fqn}: dtype {param.dtype} (local {param.to_local().dtype}) after "
            f"{name}, expected {dtype}"
        )
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(41)).to(ctx.device, dtype)
    with torch.no_grad():
        out, expected = model(x), oracle(x)
    want = {"lin.weight": (dtype, (3, 4)), "empty": (dtype, (0, 4))}
    assert model.seen[-1] == want, (
        f"{ctx.where()} {name}: forward computed with {model.seen[-1]}, expected {want}"
    )
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-7, atol=1e-9)
    assert out.dtype == dtype and torch.allclose(out, expected, **tol), (
        f"{ctx.where()} {name}: output {out.dtype} differs from the converted oracle's "
        f"(max |diff| {(out.double() - expected.double()).abs().max().item():.3g})"
    )
