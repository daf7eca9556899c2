"""Checks for the node-loss test of the torchrun path (tests/harness/test_torchrun.py), collected
with ``--check-dir tests/harness/nodeloss_checks`` and selected with ``-k nodeloss``. They run in
definition order: one that passes, one during which the test kills the second node, one that must
never run."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from conformance.registry import check

MARKERS = "FSDP_CONFORMANCE_NODELOSS_MARKERS"  # directory the ranks announce themselves in
MODE = "FSDP_CONFORMANCE_NODELOSS_MODE"  # what the first node's ranks do meanwhile


@check(area="nodeloss")
def before_the_loss(ctx):
    """An all-reduce over every rank: passes while every node is up."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    assert t.item() == expected, f"{ctx.where()} expected {expected}, got {t.item()}"


@check(area="nodeloss")
def during_the_loss(ctx):
    """The ranks of the nodes after the first announce themselves (pid, agent pid) in $MARKERS and
    sleep, so that the test's kill of their node lands in the middle of this check. The first
    node's ranks return at once ($MODE ``idle``) or wait for them in an all-reduce that can never
    complete (``collective``: a lost peer does not make gloo's all-reduce fail)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ctx.rank >= local:
        path = Path(os.environ[MARKERS]) / f"rank{ctx.rank}"
        path.with_suffix(".tmp").write_text(f"{os.getpid()} {os.getppid()}")
        path.with_suffix(".tmp").rename(path)
        time.sleep(600)
    if os.environ.get(MODE) == "collective":
        dist.all_reduce(torch.ones(1))


@check(area="nodeloss")
def after_the_loss(ctx):
    """Never runs in the node-loss test: the run stops at the loss."""
