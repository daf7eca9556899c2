"""Long runs stay bounded: a worker rank that serves many group-building checks holds as many
process groups, threads and file descriptors after the last as after the first (see
[Note: per-check cleanup] in conformance.runner.resources and [Note: bounded ranks] in
conformance.runner.pool).

The bounds come from the run itself: after a warm-up round (which fills caches that are meant to
stay), one round of ``mesh_churn`` shows how many groups and threads a round creates; every later
round must end where the warm-up round ended, with less slack than half of what one round
creates. Without the release each round adds all of them, so the test fails from the second
round on."""

import pytest

from conformance.runner.pool import WorkerGroup
from conformance.runner.protocol import Task

CHURN = "tests.harness.selfchecks.resource_churn"
WORLD_SIZE = 4  # a 2-D mesh needs 4 ranks
ROUNDS = 5  # after the warm-up


def _run(group, name, **kwargs):
    results = group.run(Task(f"{CHURN}:{name}", None, kwargs, timeout=180))
    bad = [r for r in results if not r.ok]
    assert not bad, f"{name} failed on rank {bad[0].rank}: {bad[0].status}\n{bad[0].detail}"
    return [r.value for r in results]


@pytest.fixture(scope="module")
def group():
    # No headroom: the driver must not recycle the group, the ranks must stay bounded themselves.
    g = WorkerGroup(WORLD_SIZE, grace=5.0, thread_headroom=None, fd_headroom=None)
    yield g
    g.close()


def test_group_building_checks_leave_counts_flat(group):
    _run(group, "mesh_churn")  # warm-up: caches that are meant to stay fill here
    base = _run(group, "census")
    pids = group.pids()
    churn = _run(group, "mesh_churn")  # measures what one round creates
    created_groups = [c["created"] for c in churn]
    created_threads = [c["threads"] - b["threads"] for c, b in zip(churn, base)]
    created_fds = [c["fds"] - b["fds"] for c, b in zip(churn, base)]
    assert all(n > 0 for n in created_groups) and all(n > 0 for n in created_threads), (
        "mesh_churn created no process group or thread on some rank "
        f"(groups {created_groups}, threads {created_threads}): this test cannot fail as it is"
    )
    history = []
    for round_ in range(ROUNDS):
        if round_:
            _run(group, "mesh_churn")
        now = _run(group, "census")
        history.append(now)
        for rank in range(WORLD_SIZE):
            assert now[rank]["groups"] == base[rank]["groups"], (
                f"rank {rank} holds {now[rank]['groups']} process groups after round "
                f"{round_ + 1}, {base[rank]['groups']} after the warm-up (a round creates "
                f"{created_groups[rank]}); history {[h[rank]['groups'] for h in history]}"
            )
            slack = created_threads[rank] // 2
            assert now[rank]["threads"] <= base[rank]["threads"] + slack, (
                f"rank {rank} has {now[rank]['threads']} threads after round {round_ + 1}, "
                f"{base[rank]['threads']} after the warm-up (a round creates "
                f"{created_threads[rank]}, slack {slack}); "
                f"history {[h[rank]['threads'] for h in history]}"
            )
            assert now[rank]["fds"] <= base[rank]["fds"] + created_fds[rank] // 2, (
                f"rank {rank} holds {now[rank]['fds']} file descriptors after round "
                f"{round_ + 1}, {base[rank]['fds']} after the warm-up (a round opens "
                f"{created_fds[rank]}); "
                f"history {[h[rank]['fds'] for h in history]}"
            )
            assert now[rank]["lingering"] == 0, (
                f"rank {rank}: {now[rank]['lingering']} destroyed groups are still referenced"
            )
    assert group.pids() == pids and group.spawn_count == 1, "the group was restarted"


def test_a_group_named_by_its_ranks_forms_again_after_the_release(group):
    # [Note: per-check cleanup]: destroying such a group between checks would give the next one
    # its name, and gloo would rendezvous with the destroyed group's addresses (a hang)
    for _ in range(3):
        sizes = group.run(Task(f"{CHURN}:local_sync_group", None, {}, timeout=30))
        bad = [r for r in sizes if not r.ok]
        assert not bad, f"rank {bad[0].rank}: {bad[0].status}\n{bad[0].detail[-800:]}"
        assert [r.value for r in sizes] == [float(WORLD_SIZE)] * WORLD_SIZE


def test_checkpoint_save_jobs_leave_counts_flat():
    """``state_dict::reshard_dcp`` forks a save job (ranks of their own, from a server the rank
    starts once): after each job the rank holds the threads, descriptors, child processes and
    groups it held after the first."""
    g = WorkerGroup(2, grace=5.0, thread_headroom=None, fd_headroom=None)
    reshard = ("conformance.checks.state_dict.reshard:reshard_dcp", "torch-fsdp2", {"w1": 2})

    def save_job_round():
        _run(g, "forget_checkpoints")
        results = g.run(Task(*reshard[:2], reshard[2], timeout=300))
        assert all(r.ok for r in results), [r.detail for r in results]
        return _run(g, "census")

    try:
        base = save_job_round()  # warm-up: starts the save-job server
        for round_ in range(3):
            now = save_job_round()
            # the previous round's job wrote a fresh checkpoint (so a job did run)
            assert _run(g, "forget_checkpoints")[0] >= 1
            for rank in range(2):
                for key in ("threads", "fds", "children", "groups"):
                    assert now[rank][key] <= base[rank][key], (
                        f"rank {rank} holds {now[rank][key]} {key} after save job "
                        f"{round_ + 2}, {base[rank][key]} after the first"
                    )
    finally:
        g.close()
