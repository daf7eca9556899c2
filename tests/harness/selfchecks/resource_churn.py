"""Task bodies for tests/harness/test_leaks.py: checks that build process groups the way real
checks do, and a census of what a rank holds. They are run as runner tasks (``fn(ctx)`` on every
rank of a ``WorkerGroup``), not registered as checks, so a ``--check-dir`` run collects nothing
from this module."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.runner import lifeline
from conformance.runner.resources import LEDGER, fd_count, live_groups, thread_count


def _sum_over(group) -> float:
    """All-reduce 1.0 over ``group`` (connects its gloo pairs); returns the group's size."""
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return value.item()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def mesh_churn(ctx) -> dict:
    """One round of what group-building checks do, each time on fresh objects: a 2-D
    ``DeviceMesh`` (HSDP), ``init_device_mesh`` of another 2-D shape (TP-like), a ``new_group``,
    FSDP2 with HSDP and with an integer ``reshard_after_forward`` (its post-forward mesh), FSDP1
    ``HYBRID_SHARD`` on a 2-D mesh, and a DCP save and load. Returns how many groups this rank held
    at its end beyond those at its start, and its thread and descriptor counts then."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

    ws = ctx.world_size
    if ws % 2:
        raise ValueError(f"mesh_churn needs an even world size, not {ws}")
    groups_before = len(live_groups())
    hsdp = DeviceMesh("cpu", torch.arange(ws).view(2, ws // 2), mesh_dim_names=("rep", "shard"))
    tp = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    pair = dist.new_group([0, 1])
    sizes = [_sum_over(hsdp.get_group(d)) for d in ("rep", "shard")]
    sizes += [_sum_over(tp.get_group(d)) for d in ("dp", "tp")]
    if ctx.rank in (0, 1):
        sizes.append(_sum_over(pair))

    inputs = torch.randn(4, 8)
    model = _model()
    fully_shard(model, mesh=hsdp)  # HSDP: DTensor parameters on the 2-D mesh
    model(inputs).sum().backward()
    flat = init_device_mesh("cpu", (ws,))
    raf = _model()
    fully_shard(raf, mesh=flat, reshard_after_forward=2)  # a post-forward mesh of 2-rank groups
    raf(inputs).sum().backward()
    hybrid = FullyShardedDataParallel(
        _model(),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=hsdp,
        device_id=ctx.device,
    )
    hybrid(inputs).sum().backward()

    path = [tempfile.mkdtemp(prefix="fsdp-conformance-churn-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path)
    state = {"w": torch.full((ws, 3), float(ctx.rank)).chunk(ws)[ctx.rank].clone()}
    dcp.save(state, checkpoint_id=path[0])
    dcp.load(state, checkpoint_id=path[0])
    dist.barrier()
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(path[0], ignore_errors=True)
    return {
        "created": len(live_groups()) - groups_before,
        "threads": thread_count(),
        "fds": fd_count(),
        "sizes": sizes,
    }


def census(ctx) -> dict:
    """What this rank holds now, once the release of the previous task is complete."""
    assert LEDGER.settle(60), "the reaper did not free the destroyed groups within 60 s"
    return {
        "threads": thread_count(),
        "fds": fd_count(),
        "groups": len(live_groups()),
        "lingering": LEDGER.lingering(),
        "children": len(lifeline.child_pids(os.getpid())),
        "pid": os.getpid(),
    }


def forget_checkpoints(ctx) -> int:
    """Remove the run's checkpoint cache, so that the next ``state_dict::reshard_dcp`` starts a
    save job again; returns how many checkpoints it held (rank 0; 0 elsewhere)."""
    import shutil

    from conformance.checks.state_dict import reshard

    held = 0
    if ctx.rank == 0:
        root = reshard._cache_root()
        held = len(list(root.glob("*-ws*"))) if root.exists() else 0
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    return held


def start_idle_threads(ctx, count: int = 8) -> int:
    """Leave ``count`` threads running that never end (what the driver's headroom bounds)."""
    stop = threading.Event()
    for _ in range(count):
        threading.Thread(target=stop.wait, daemon=True).start()
    return thread_count()


def pending_on_subgroup(ctx) -> None:
    """Every rank builds a sub-group; rank 1 starts an all-reduce on it that no other rank
    joins, then raises (the release of a group with a collective pending must not hang)."""
    group = dist.new_group(list(range(ctx.world_size)))
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1), group=group, async_op=True)
        raise RuntimeError("rank 1 gives up with an all-reduce pending on a sub-group")


def all_reduce_ranks(ctx) -> float:
    """An ordinary all-reduce over the default group: the sum of rank + 1."""
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return value.item()


def local_sync_group(ctx) -> float:
    """A group named by a hash of its ranks (``use_local_synchronization=True``, as FSDP2's
    separate reduce-scatter group), rank 0 getting there first; returns its all-reduced size."""
    if ctx.rank:
        time.sleep(0.3)
    group = dist.new_group(list(range(ctx.world_size)), use_local_synchronization=True)
    return _sum_over(group)
