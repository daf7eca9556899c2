"""The suite launched by torchrun across two "nodes" on this host (docs/multi-node.md): two agents
of 2 ranks each, c10d rendezvous on 127.0.0.1. One run checks its report against the same cases
run by the worker pool; another loses its second node mid-check and must end with an error naming
the lost ranks, the partial report written by rank 0 and exit code 6 on rank 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG = "FSDP_CONFORMANCE_TORCHRUN_TEST"  # in the environment of every process a test starts
MARKERS = "FSDP_CONFORMANCE_NODELOSS_MARKERS"  # tests/harness/nodeloss_checks announces ranks here
STARTUP = 150  # seconds for both agents' rendezvous and the first check, on a loaded 2-core host
# a few layout cases of two implementations: passes and one expected failure (torch-fsdp2 keeps no
# rows of a zero-numel parameter), all quick
SELECTION = [
    "--impl",
    "reference,torch-fsdp2",
    "-k",
    "per_param_dim0_local_shard and (uneven or zero-trailing-2d)",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _own_processes(tag: str) -> list[int]:
    """Processes whose environment carries ``TAG=tag``: the agents and every rank they started
    (ranks get their own sessions, so the agents' process groups do not hold them)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Agents:
    """Two torchrun agents ("node 0" hosting the rendezvous, then "node 1"), each with 2 ranks."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict | None = None):
        self.tag = uuid.uuid4().hex
        self.port = _free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        base = {**os.environ, "OMP_NUM_THREADS": "1", TAG: self.tag, **(env or {})}
        for node in (0, 1):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{self.port}",
                "--rdzv-id",
                f"test-{self.tag[:8]}",
                # node 0 hosts the rendezvous store and, its address sorting first, gets ranks 0
                # and 1 (equal addresses would be ordered by the agents' pids, which wrap around)
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "--local-addr",
                "127.0.0.1" if node == 0 else "localhost",
                "-m",
                "conformance",
                *args,
                "--reports-dir",
                str(tmp_path / "reports"),
                "-p",
                "no:cacheprovider",
            ]
            out = open(tmp_path / f"agent{node}.log", "w+")  # noqa: SIM115 - closed in stop()
            self.logs.append(out)
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=base,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            if node == 0:
                self._wait(lambda: _listening(self.port), 60, "node 0's rendezvous store")

    def _wait(self, ready, seconds: float, what: str) -> None:
        end = time.monotonic() + seconds
        while not ready():
            if time.monotonic() > end or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"{what} not ready after {seconds} s\n{self.output(0)}")
            time.sleep(0.1)

    def output(self, node: int) -> str:
        self.logs[node].flush()
        return Path(self.logs[node].name).read_text()

    def wait(self, node: int, seconds: float) -> int:
        try:
            return self.procs[node].wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {node} still running after {seconds} s\n{self.output(node)}")

    def stop(self) -> None:
        """SIGTERM the agents (they stop their ranks), then SIGKILL whatever this test started."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + 10
        while _own_processes(self.tag) and time.monotonic() < end:
            time.sleep(0.2)
        for pid in _own_processes(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(10)
        for f in self.logs:
            f.close()


@pytest.fixture
def agents(tmp_path):
    started = []

    def start(args, env=None):
        started.append(Agents(tmp_path, args, env))
        return started[-1]

    yield start
    for a in started:
        a.stop()
    assert not any(_own_processes(a.tag) for a in started), "processes outlived the test"


def _outcomes(report: dict) -> dict[str, str]:
    return {f"{c['impl']} {c['id']}": c["outcome"] for c in report["cases"]}


def test_two_agents_run_the_same_cases_as_the_worker_pool(agents, tmp_path):
    """2 nodes x 2 ranks under torchrun: one world size, 4; rank 0's report holds every selected
    case with the outcome the worker pool gives the same cases at world size 4."""
    pool = subprocess.run(
        [sys.executable, "-m", "conformance", *SELECTION, "--world-sizes", "4", "--reports-dir",
         str(tmp_path / "pool"), "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=STARTUP,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert pool.returncode == 0, pool.stdout[-3000:] + pool.stderr[-3000:]
    expected = _outcomes(json.loads((tmp_path / "pool" / "conformance.json").read_text()))
    assert len(expected) == 8 and set(expected.values()) == {"pass", "xfail"}, expected

    run = agents(SELECTION)
    codes = [run.wait(0, STARTUP), run.wait(1, 60)]
    assert codes == [0, 0], run.output(0)[-4000:] + run.output(1)[-2000:]
    assert "world sizes 4 (cpu/gloo) [torchrun: in-process]" in run.output(0)
    assert run.output(1).count("passed") == 0, "only rank 0 (node 0) prints the session"
    report = json.loads((tmp_path / "reports" / "conformance.json").read_text())
    assert report["torchrun"] is True and report["world_sizes"] == [4], report["world_sizes"]
    assert {c["world_size"] for c in report["cases"]} == {4}
    assert _outcomes(report) == expected
    assert report["interrupted"] is False and report["cases_not_run"] == 0


@pytest.mark.parametrize("survivors", ["idle", "collective"])
def test_losing_a_node_mid_check_ends_the_run_naming_the_lost_ranks(agents, tmp_path, survivors):
    """SIGKILL node 1 (its agent and its two ranks) while its ranks sleep in a check, node 0's
    ranks having returned (``idle``: they wait for the results) or waiting for node 1 in an
    all-reduce (``collective``: stuck there, or failed by gloo): rank 0 must fail that case
    naming ranks 2 and 3 as lost, stop the run (the next check never runs), write the partial
    report into its run directory and exit with 6; its agent then fails."""
    markers = tmp_path / "markers"
    markers.mkdir()
    run = agents(
        ["--impl", "tests.harness.fake_impl:FakeImpl", "--check-dir", "tests/harness/nodeloss_checks",
         "-k", "nodeloss", "--check-timeout", "4", "--grace", "0"],
        env={MARKERS: str(markers), "FSDP_CONFORMANCE_NODELOSS_MODE": survivors},
    )  # fmt: skip
    run._wait(lambda: len(list(markers.glob("rank?"))) == 2, STARTUP, "node 1's ranks in the check")
    ranks = {p.name: [int(x) for x in p.read_text().split()] for p in markers.glob("rank?")}
    assert sorted(ranks) == ["rank2", "rank3"], ranks
    assert {agent for _, agent in ranks.values()} == {run.procs[1].pid}, (
        f"ranks 2 and 3 should run under node 1's agent {run.procs[1].pid}: {ranks}"
    )
    killed_at = time.monotonic()
    os.killpg(run.procs[1].pid, signal.SIGKILL)  # the node goes: its agent and its ranks at once
    for pid, _ in ranks.values():
        os.kill(
            pid, signal.SIGKILL
        )  # raises if the rank was already gone: the kill landed mid-check

    assert run.wait(0, 60) != 0
    ended = time.monotonic() - killed_at
    out = run.output(0)
    assert "lost ranks 2, 3 (node 1" in out, out[-4000:]
    assert "INTERRUPTED by lost ranks 2, 3" in out
    assert "exitcode  : 6" in out, "rank 0's exit code, as torchrun reports it:\n" + out[-3000:]
    assert ended < 4 + 5 + 30, f"the loss took {ended:.0f} s to end the run"
    runs = list((tmp_path / "reports" / "runs").glob("*/conformance.json"))
    assert len(runs) == 1 and not (tmp_path / "reports" / "conformance.json").exists()
    report = json.loads(runs[0].read_text())
    assert report["interrupted"] is True and report["signal"].startswith("lost ranks 2, 3")
    assert report["cases_run"] == 2 and report["cases_not_run"] == 1
    by_name = {c["check"]: c for c in report["cases"]}
    assert by_name["before_the_loss"]["outcome"] == "pass"
    lost = by_name["during_the_loss"]
    assert lost["outcome"] == "fail"
    statuses = {r["rank"]: r["status"] for r in lost["ranks"]}
    if survivors == "idle":
        assert statuses == {0: "ok", 1: "ok", 2: "died", 3: "died"}, statuses
    else:  # gloo fails the all-reduce on some survivors and leaves others in it
        assert statuses[2] == statuses[3] == "died", statuses
        assert {statuses[0], statuses[1]} <= {"timeout", "error"}, statuses
        stuck = sorted(r for r in (0, 1) if statuses[r] == "timeout")
        if stuck:
            assert "stuck in the check past its budget" in report["signal"]
    assert "after_the_loss" not in by_name


def test_world_sizes_must_match_the_launched_world(tmp_path):
    """Under torchrun, --world-sizes other than $WORLD_SIZE is a usage error (exit 2, one line)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--impl", "tests.harness.fake_impl:FakeImpl",
         "--world-sizes", "1,2", "--reports-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--world-sizes: 1,2 asked for, but this job has WORLD_SIZE=4 ranks" in proc.stderr
    assert "pass --world-sizes 4 or drop it" in proc.stderr


def test_launched_sizes_count_this_nodes_ranks_for_the_device(monkeypatch):
    """The one world size is $WORLD_SIZE; the automatic device compares the node's GPUs with its
    own ranks ($LOCAL_WORLD_SIZE), not the job's; an explicit device needs a GPU per local rank."""
    from conformance import devices, options
    from conformance.runner.inprocess import launched_sizes

    monkeypatch.setattr(devices, "accelerator_count", lambda kind: 2 if kind == "cuda" else 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes x 2 ranks, 2 GPUs per node
    assert launched_sizes(None, None, None) == ([4], {4: ("cuda", "nccl")})
    assert launched_sizes("4", "cuda", None) == ([4], {4: ("cuda", "nccl")})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 1 node x 4 ranks on 2 GPUs
    assert launched_sizes(None, None, None) == ([4], {4: ("cpu", "gloo")})
    with pytest.raises(options.UsageError, match="4 ranks on this node .* need 4 cuda devices"):
        launched_sizes(None, "cuda", None)
    with pytest.raises(options.UsageError, match="2,4 asked for, but this job has WORLD_SIZE=4"):
        launched_sizes("2,4", None, None)
