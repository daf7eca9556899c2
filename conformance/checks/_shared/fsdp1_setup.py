"""FSDP1 set-up helpers that checks of ``fsdp1/`` and ``state_dict/`` share (no checks here): the
capabilities of a plain FSDP1 unit, the ``device_id`` a CPU run passes, batches that are the same
on every rank, and ``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))``.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import B

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _kwargs(ctx):
    return {"device_id": torch.device("cpu")} if ctx.device.type == "cpu" else {}


def _x(ctx, n_in: int, salt: int) -> torch.Tensor:
    """The same batch on every rank (so the averaged gradient is the oracle's on it)."""
    return torch.randn(B, n_in, generator=torch.Generator().manual_seed(salt)).to(ctx.device)


def _global_batch(ctx, salt: int, dtype=torch.float32) -> torch.Tensor:
    """``ws * B`` samples of 4 features, the same on every rank."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(ctx.world_size * B, 4, generator=g, dtype=dtype).to(ctx.device)


def _batch(ctx, salt: int) -> torch.Tensor:
    """``B`` samples of 4 features, the same on every rank."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(B, 4, generator=g).to(ctx.device)


def _nested(ctx, fsdp, child_kwargs=None, root_kwargs=None):
    """``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))``."""
    ctx.seed(0)
    child = fsdp(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx), **(child_kwargs or {}))
    seq = nn.Sequential(child, nn.Linear(4, 4).to(ctx.device))
    return fsdp(seq, **_kwargs(ctx), **(root_kwargs or {}))
