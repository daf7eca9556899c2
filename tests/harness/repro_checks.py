"""Stand-in fuzz checks for the reproducer's exit-code tests (``tests/harness/test_reporting.py``):
a repro script calls ``check(ctx, example=..., **case)`` like the fuzz area's checks."""


def passes(ctx, example):
    """Accepts every example."""


def fails_on_last_rank(ctx, example):
    """The last rank rejects every example."""
    assert ctx.rank != ctx.world_size - 1, f"[rank {ctx.rank}] rejects the example on purpose"
