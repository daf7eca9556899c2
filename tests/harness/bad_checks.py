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


def rank1_raises_rank0_waits(ctx):
    """Rank 1 raises; rank 0 then waits in a collective rank 1 never joins."""
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))
    return "never"


def rank1_exits(ctx):
    if ctx.rank == 1:
        os._exit(7)
    return "fine"


def rank1_raises_after_async_all_reduce(ctx):
    """Rank 1 starts an all-reduce the other ranks never join, then raises; they return."""
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1), async_op=True)
        raise RuntimeError("rank 1 gives up with an all-reduce pending")
    return "fine"


def spawns_sleeper(ctx, path):
    """Rank 0 starts a child process that would outlive it and writes its pid to ``path``; every
    rank hangs."""
    import subprocess
    import sys
    import time

    if ctx.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(path, "w") as f:
            f.write(str(child.pid))
    time.sleep(600)


def all_ranks_raise(ctx):
    raise AssertionError(f"{ctx.where()} fails the same way everywhere")
