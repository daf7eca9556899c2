"""Area "fsdp1_runtime": FSDP1's ``ShardedGradScaler`` defaults and sparse float16 gradients
(R104, R105).

The oracle is the rule: torch.amp.GradScaler's documented default ``init_scale`` (2**16), and for
``unscale_`` the coalesced sparse gradient computed by hand (duplicate indices summed, then
divided by the scale).
"""

from __future__ import annotations

import importlib

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_GRAD_SCALER}


def _scaler_cls(ctx):
    return importlib.import_module(f"{ctx.impl.ns.__name__}.sharded_grad_scaler").ShardedGradScaler


# ------------------------------------------------------------------------------ R104
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def grad_scaler_default_init_scale(ctx):
    """R104: ``ShardedGradScaler(device=<device type>)`` without ``init_scale`` starts at
    torch.amp.GradScaler's default scale 2**16: ``get_scale()`` is 65536.0 and ``scale(t)`` of a
    one-element tensor 1.0 gives 65536.0."""
    scaler = _scaler_cls(ctx)(device=ctx.device.type)
    want = 2.0**16
    got = scaler.scale(torch.tensor(1.0, device=ctx.device))
    assert got.item() == want, f"{ctx.where()} scale(tensor(1.0)) gave {got.item()}, not {want}"
    assert scaler.get_scale() == want, (
        f"{ctx.where()} get_scale() of a default scaler is {scaler.get_scale()}, not {want}"
    )


# ------------------------------------------------------------------------------ R105
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def grad_scaler_unscale_sparse_fp16(ctx):
    """R105: ``unscale_`` over a float16 sparse COO gradient with duplicate indices (rows 0, 0, 3
    of a (5, 2) parameter; scale 2.0) succeeds, leaves the gradient coalesced and float16, its
    dense value the duplicates summed, divided by the scale."""
    p = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.float16, device=ctx.device))
    values = torch.tensor([[1.0, 2.0], [2.0, 4.0], [4.0, 6.0]], dtype=torch.float16)
    p.grad = torch.sparse_coo_tensor([[0, 0, 3]], values, (5, 2)).to(ctx.device)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = _scaler_cls(ctx)(device=ctx.device.type, init_scale=2.0)
    scaler.scale(torch.tensor(1.0, device=ctx.device))
    scaler.unscale_(opt)
    assert p.grad.is_sparse and p.grad.is_coalesced() and p.grad.dtype == torch.float16, (
        f"{ctx.where()} after unscale_: sparse {p.grad.is_sparse}, coalesced "
        f"{p.grad.is_coalesced()}, dtype {p.grad.dtype}; expected a coalesced float16 sparse grad"
    )
    want = torch.zeros(5, 2)
    want[0] = torch.tensor([3.0, 6.0]) / 2.0
    want[3] = torch.tensor([4.0, 6.0]) / 2.0
    assert_close(
        ctx, "unscaled sparse fp16 grad", p.grad.to_dense().float().cpu(), want, FP32["param"]
    )
