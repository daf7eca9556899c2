"""The runner's promises, shown with deliberately bad check bodies (tests/harness/bad_checks.py)."""

import os
import time

import pytest

from conformance.runner import protocol
from conformance.runner.pool import WorkerGroup
from conformance.runner.protocol import Task

BAD = "tests.harness.bad_checks"


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(2, grace=2.0)
    yield g
    pids = g.pids()
    g.close()
    for pid in pids:  # no orphans
        assert not _alive(pid), f"worker {pid} survived close()"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split()[2] != "Z"


def test_healthy_check_returns_every_rank_value(group):
    results = group.run(Task(f"{BAD}:ok", None, {}, timeout=30))
    assert [r.status for r in results] == ["ok", "ok"]
    assert [r.value for r in results] == [3.0, 3.0]  # 1 + 2 summed over two ranks


def test_group_is_reused_between_checks(group):
    before = group.spawn_count
    pids = group.pids()
    for _ in range(3):
        assert all(r.ok for r in group.run(Task(f"{BAD}:ok", None, {}, timeout=30)))
    assert group.spawn_count == before and group.pids() == pids


def test_deadlock_reported_with_stacks_and_next_check_runs(group):
    timeout = 3.0
    start = time.monotonic()
    results = group.run(Task(f"{BAD}:deadlock", None, {}, timeout=timeout))
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 5, f"deadlock took {elapsed:.1f} s to report"
    assert results[1].status == protocol.TIMEOUT
    assert (
        "deadlock" in results[1].detail and "bad_checks.py" in results[1].detail
    )  # rank 1's stack
    assert (
        "stack at teardown" in results[0].detail and "File" in results[0].detail
    )  # rank 0's stack
    after = group.run(
        Task(f"{BAD}:ok", None, {}, timeout=30)
    )  # a fresh group serves the next check
    assert [r.status for r in after] == ["ok", "ok"]


def test_rank_raising_reports_its_traceback(group):
    results = group.run(Task(f"{BAD}:rank1_raises", None, {}, timeout=30))
    assert results[0].status == protocol.OK
    assert results[1].status == protocol.ERROR
    assert "ValueError: rank 1 refuses" in results[1].detail


@pytest.mark.parametrize("fits", [True, False])
def test_settled_verdict_cuts_the_grace_short(group, fits):
    """[Note: a settled verdict]: once a failure fits the case's expectation the waiting rank
    gets SETTLED_GRACE, not --grace; a failure that does not fit keeps the full grace."""
    from conformance.runner.pool import SETTLED_GRACE

    task = Task(f"{BAD}:rank1_raises_rank0_waits", None, {}, timeout=30)
    results = group.run(task, settled=lambda r: fits and "ValueError" in r.detail)
    assert results[1].status == protocol.ERROR and "rank 1 refuses" in results[1].detail
    assert results[0].status == protocol.TIMEOUT
    given = SETTLED_GRACE if fits else group.grace
    assert f"still running {given:g} s after another rank failed" in results[0].detail


def test_rank_dying_reports_exit_code_and_group_restarts(group):
    results = group.run(Task(f"{BAD}:rank1_exits", None, {}, timeout=30))
    assert results[1].status == protocol.DIED
    assert "exited with code 7" in results[1].detail
    assert all(r.ok for r in group.run(Task(f"{BAD}:ok", None, {}, timeout=30)))


def test_rank_raising_with_a_collective_pending_does_not_poison_the_next_check(group):
    """Rank 1 raises after starting an all-reduce the other rank never joins; the group still has
    that collective pending. The health probe must catch it (and restart the group), so the next,
    independent check passes within its own time instead of pairing with the leftover."""
    failures = group.probe_failures
    results = group.run(Task(f"{BAD}:rank1_raises_after_async_all_reduce", None, {}, timeout=30))
    assert [r.status for r in results] == ["ok", "error"]
    after = group.run(Task(f"{BAD}:ok", None, {}, timeout=10))
    assert [r.status for r in after] == ["ok", "ok"], [r.detail for r in after]
    assert [r.value for r in after] == [3.0, 3.0]
    assert group.probe_failures == failures + 1


def test_a_clean_failure_keeps_the_group(group):
    """Every rank raising at the same point leaves nothing pending: the probe passes, no respawn."""
    group.run(Task(f"{BAD}:ok", None, {}, timeout=30))
    spawns, failures = group.spawn_count, group.probe_failures
    results = group.run(Task(f"{BAD}:all_ranks_raise", None, {}, timeout=30))
    assert {r.status for r in results} == {"error"}
    assert group.spawn_count == spawns and group.probe_failures == failures


def test_timed_out_rank_reports_its_real_duration(group):
    results = group.run(Task(f"{BAD}:deadlock", None, {}, timeout=2.0))
    assert results[1].status == protocol.TIMEOUT
    assert results[1].duration >= 2.0, results[1].duration


def test_killing_a_group_ends_what_its_workers_started_and_removes_its_temp_dir(tmp_path):
    g = WorkerGroup(2, grace=1.0)
    try:
        g.start()
        stack_dir = g._stack_dir
        assert stack_dir and os.path.isdir(stack_dir)
        path = tmp_path / "child.pid"
        results = g.run(Task(f"{BAD}:spawns_sleeper", None, {"path": str(path)}, timeout=4))
        assert {r.status for r in results} == {protocol.TIMEOUT}
        child = int(path.read_text())
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "a check's subprocess survived its group"
        assert not os.path.exists(stack_dir), "the group's temporary directory was left behind"
    finally:
        g.close()


CHURN = "tests.harness.selfchecks.resource_churn"


def test_a_group_that_outgrows_its_thread_headroom_is_recycled():
    """[Note: bounded ranks]: threads a check leaves running are not the rank's to stop; once a
    rank holds more than its start-up count plus the headroom, the driver restarts the group."""
    headroom = 16
    g = WorkerGroup(2, grace=1.0, thread_headroom=headroom, fd_headroom=None)
    try:
        assert all(r.ok for r in g.run(Task(f"{CHURN}:census", None, {}, timeout=30)))
        pids, recycles = g.pids(), g.recycles
        left = g.run(Task(f"{CHURN}:start_idle_threads", None, {"count": 2 * headroom}, timeout=30))
        assert all(r.ok for r in left), [r.detail for r in left]  # the check itself passed
        assert g.recycles == recycles + 1 and not g.alive
        after = g.run(Task(f"{CHURN}:census", None, {}, timeout=30))
        assert all(r.ok for r in after) and g.pids() != pids
        assert all(r.value["threads"] < v for r, v in zip(after, [x.value for x in left]))
    finally:
        g.close()


def test_a_group_within_its_headroom_is_kept():
    g = WorkerGroup(2, grace=1.0, thread_headroom=64, fd_headroom=None)
    try:
        assert all(r.ok for r in g.run(Task(f"{CHURN}:start_idle_threads", None, {}, timeout=30)))
        pids = g.pids()
        assert all(r.ok for r in g.run(Task(f"{CHURN}:census", None, {}, timeout=30)))
        assert g.recycles == 0 and g.pids() == pids
    finally:
        g.close()


def test_driver_exit_removes_the_temp_dirs_of_its_children(tmp_path, monkeypatch):
    """The checkpoint cache is named by the workers' parent, the driver's forkserver child: the
    driver's exit removes it along with its own, and leaves other processes' directories alone."""
    import subprocess
    import sys
    import tempfile

    from conformance.runner import lifeline

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f"{lifeline.TEMP_PREFIX}sd-{child.pid}"
        own = tmp_path / f"{lifeline.TEMP_PREFIX}ws2-{os.getpid()}-x"
        other = tmp_path / f"{lifeline.TEMP_PREFIX}sd-{os.getppid()}"  # alive, not ours
        for path in (mine, own, other):
            path.mkdir()
        lifeline.remove_stale_dirs(owner=os.getpid())
        assert not mine.exists() and not own.exists() and other.exists()
    finally:
        child.kill()
        child.wait()


def test_a_sub_group_left_with_a_collective_pending_does_not_block_the_next_check():
    """The release of the groups a check created happens before the next message (here the
    health probe): a sub-group with a collective pending on one rank is destroyed or the group
    restarted, and the next check runs within its own time either way."""
    g = WorkerGroup(2, grace=1.0)
    try:
        results = g.run(Task(f"{CHURN}:pending_on_subgroup", None, {}, timeout=30))
        assert [r.status for r in results] == ["ok", "error"], [r.detail for r in results]
        after = g.run(Task(f"{CHURN}:all_reduce_ranks", None, {}, timeout=15))
        assert [r.value for r in after] == [3.0, 3.0], [r.detail for r in after]
    finally:
        g.close()
