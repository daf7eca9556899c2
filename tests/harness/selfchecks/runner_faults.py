"""Checks that misbehave towards the runner (collected with --check-dir tests/harness/selfchecks;
select them with ``-k runner``). They run in definition order."""

import torch
import torch.distributed as dist

from conformance.registry import check


@check(area="runner", world_sizes=[2])
def leaves_all_reduce_pending(ctx):
    """Rank 1 starts an all-reduce that rank 0 never joins, then raises; rank 0 returns."""
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1), async_op=True)
        raise RuntimeError("rank 1 gives up with an all-reduce pending")


@check(area="runner", world_sizes=[2])
def independent_after_pending(ctx):
    """An ordinary all-reduce: passes in a healthy group (it runs right after the one above)."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0, f"{ctx.where()} expected 3.0, got {t.item()}"


@check(area="runner", world_sizes=[2])
def long_failure(ctx):
    """Fails with a message far longer than the report keeps; the cause is at its end."""
    raise AssertionError("noise " * 6000 + "THE-REAL-CAUSE-AT-THE-END")
