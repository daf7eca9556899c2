"""Checks used only by the harness self-tests (collected with --check-dir tests/harness/selfchecks)."""

import os

import torch
import torch.distributed as dist

from conformance.registry import check


@check(area="selftest", world_sizes=[2])
def passes(ctx):
    """All ranks agree on a sum."""
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


@check(area="selftest", world_sizes=[2])
def fails_on_rank1(ctx):
    """Rank 1 reports a wrong value."""
    assert ctx.rank != 1, f"{ctx.where()} expected 0, got 1"


@check(area="selftest", world_sizes=[2], timeout=4)
def deadlocks(ctx):
    """Rank 0 skips the all-reduce the other rank enters."""
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1))


@check(area="selftest", world_sizes=[2])
def exits_on_rank1(ctx):
    """Rank 1's process exits in the middle of the check."""
    if ctx.rank == 1:
        os._exit(7)


@check(area="selftest", world_sizes=[2], requires={"hsdp"})
def needs_hsdp(ctx):
    """Needs a capability the fake implementation does not declare."""
    raise AssertionError("must never run without the capability")


@check(area="selftest", world_sizes=[2], timeout=120)
def sleeps(ctx):
    """Runs long enough for the Ctrl-C self-test to interrupt it."""
    import time

    print("selftest-sleeping", flush=True)
    time.sleep(100)
