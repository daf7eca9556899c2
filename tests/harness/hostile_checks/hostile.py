"""Checks for tests/harness/test_hostile.py (collected with --check-dir
tests/harness/hostile_checks): quick ones, one that sleeps until it is interrupted, and one that
allocates until something stops it. They run in definition order."""

import time

import torch
import torch.distributed as dist

from conformance.registry import check

AREA = "hostile"
RUNAWAY_CAP = 6 * 2**30  # bytes: where the runaway gives up by itself (a safety net only)


@check(area=AREA)
def quick_sum(ctx):
    """An all-reduce of ones: the sum is the world size."""
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size, f"{ctx.where()} expected {ctx.world_size}, got {t.item()}"


@check(area=AREA)
def quick_fail(ctx):
    """Fails on every rank, with a message long enough to fill a report."""
    raise AssertionError(f"{ctx.where()} fails on purpose " + "x" * 4000)


@check(area=AREA, timeout=600)
def sleeps(ctx):
    """Runs until the run is interrupted."""
    print("hostile-sleeping", flush=True)
    time.sleep(600)


@check(area=AREA, world_sizes=[2])
def allocates_without_bound(ctx):
    """Rank 1 allocates (and touches) memory until it is stopped; rank 0 returns."""
    if ctx.rank == 1:
        hoard = []
        while sum(t.numel() for t in hoard) * 4 < RUNAWAY_CAP:
            hoard.append(torch.ones(16 * 2**20))  # 64 MiB, written
            time.sleep(0.02)
        raise AssertionError(f"{ctx.where()} allocated {RUNAWAY_CAP} bytes and nothing stopped it")


@check(area=AREA, world_sizes=[2])
def after_the_runaway(ctx):
    """An ordinary all-reduce right after the runaway: passes in a restarted, healthy group."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0, f"{ctx.where()} expected 3.0, got {t.item()}"
