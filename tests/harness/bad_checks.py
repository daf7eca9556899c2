"""Deliberately misbehaving check bodies used by the runner self-tests."""

import os

import torch
import torch.distributed as dist


def ok(ctx):
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def deadlock(ctx):
    """Rank 0 skips the collective the other ranks enter."""
    if ctx.rank != 0:
        dist.all_reduce(torch.ones(1))
    return "done"


def rank1_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    return "fine"


def rank1_exits(ctx):
    if ctx.rank == 1:
        os._exit(7)
    return "fine"
