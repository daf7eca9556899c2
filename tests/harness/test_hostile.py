"""Runs in hostile surroundings: a rank that allocates without bound, a full disk, a stdout whose
reader went away, a CI runner's SIGTERM (then SIGKILL), a run started with SIGINT ignored."""

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = "tests/harness/hostile_checks"
HOSTILE = f"{CHECKS}/hostile.py"
FAKE = ["--impl", "tests.harness.fake_impl:FakeImpl", "--check-dir", CHECKS]
# What a CI runner allows between its SIGTERM and its SIGKILL; the run must be done well within
# it (docs/running.md, "Exit codes and signals", gives the time measured).
GRACE_S = 10.0


def command(*args):
    return [sys.executable, "-m", "conformance", *FAKE, *args]


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _cases(report: Path) -> dict:
    return {c["id"]: c for c in json.loads(report.read_text())["cases"]}


# -- memory --------------------------------------------------------------------------------


def test_a_runaway_rank_is_killed_at_its_memory_limit_and_the_run_goes_on(tmp_path):
    out = tmp_path / "r"
    proc = subprocess.run(
        command("--world-sizes", "2", "--rank-memory-limit", "1500M", "--reports-dir", str(out),
                "-q", f"{HOSTILE}::allocates_without_bound", f"{HOSTILE}::after_the_runaway"),
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=_env(),
    )  # fmt: skip
    assert (out / "conformance.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = _cases(out / "conformance.json")
    runaway = cases["hostile::allocates_without_bound[ws2]"]
    assert runaway["outcome"] == "fail", runaway
    rank1 = runaway["ranks"][1]
    assert rank1["status"] == "died", rank1
    assert rank1["detail"].startswith(
        "rank 1 exceeded its 1.5 GiB memory limit in hostile::allocates_without_bound[ws2]"
    ), rank1["detail"]
    assert "nothing stopped it" not in runaway["message"]
    assert cases["hostile::after_the_runaway[ws2]"]["outcome"] == "pass", proc.stdout[-3000:]
    spawns = json.loads((out / "conformance.json").read_text())["process_group_spawns"]
    assert spawns == {"2": 2}, spawns  # restarted once, after the runaway
    assert proc.returncode == 1


def test_the_default_memory_limit_shares_the_host_among_ranks_and_driver():
    from conformance import options
    from conformance.runner import memory

    total = memory.mem_total()
    assert total and total > 2**30
    chosen = options.rank_memory(None)
    assert options.Options(*[None] * 10, rank_memory=chosen).memory_limit(3) == total // 4
    assert options.rank_memory("off") is None
    assert options.rank_memory("5.8G") == int(5.8 * 2**30)
    with pytest.raises(options.UsageError, match="--rank-memory-limit: 'lots' is not a memory"):
        options.rank_memory("lots")


# -- a full disk ---------------------------------------------------------------------------


def _file_size_limit(limit: int):
    def preexec():
        # SIGXFSZ ignored: a write past the limit then fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_full_disk_ends_the_run_with_one_line_and_leaves_the_previous_reports(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    previous = {
        f"conformance.{ext}": f"the previous run's {ext}\n" for ext in ("json", "md", "xml")
    }
    for name, text in previous.items():
        (out / name).write_text(text)
    proc = subprocess.run(
        command("--world-sizes", "1", "--reports-dir", str(out), "-q",
                f"{HOSTILE}::quick_sum", f"{HOSTILE}::quick_fail"),
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=_env(),
        preexec_fn=_file_size_limit(3000),  # the failure's message alone is 4000 characters
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fsdp conformance:")]
    assert len(lines) == 1, proc.stderr
    assert f"cannot write the reports into {out}" in lines[0], lines[0]
    assert "they need about" in lines[0] and "free there" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "INTERNALERROR" not in proc.stdout, proc.stderr
    assert {p.name: p.read_text() for p in out.glob("conformance.*")} == previous
    assert not [p for p in out.rglob("*.tmp")], "temporary files left behind"


# -- a closed stdout -----------------------------------------------------------------------


def test_a_closed_stdout_ends_the_run_quietly_with_its_reports(tmp_path):
    """``python -m conformance ... | head -2``: the reader goes away after two lines."""
    out = tmp_path / "r"
    proc = subprocess.Popen(
        command("--world-sizes", "1", "--reports-dir", str(out), f"{HOSTILE}::quick_sum"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    head = [proc.stdout.readline(), proc.stdout.readline()]
    proc.stdout.close()  # what head does after its two lines
    _, err = proc.communicate(timeout=400)
    assert all(head), head
    assert proc.returncode == 0, err[-3000:]
    assert "BrokenPipeError" not in err and "Traceback" not in err, err[-3000:]
    (run,) = (out / "runs").iterdir()
    for ext in ("json", "md", "xml"):
        assert (run / f"conformance.{ext}").exists(), f"{ext} missing in {run}"
        assert (out / f"conformance.{ext}").exists(), f"{ext} missing at the top level"
    assert _cases(out / "conformance.json")["hostile::quick_sum[ws1]"]["outcome"] == "pass"


# -- signals -------------------------------------------------------------------------------


def _processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _start_sleeping_run(tmp_path, sigint):
    marker = f"FSDP_HOSTILE_MARKER={os.getpid()}_{time.time_ns()}"
    key, value = marker.split("=")

    def preexec():
        signal.signal(signal.SIGINT, sigint)

    proc = subprocess.Popen(
        command("--world-sizes", "2", "--reports-dir", str(tmp_path / "r"), "-s",
                f"{HOSTILE}::quick_sum", f"{HOSTILE}::sleeps"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(**{key: value}), start_new_session=True, preexec_fn=preexec,
    )  # fmt: skip
    deadline = time.monotonic() + 200
    line = ""
    while time.monotonic() < deadline and "hostile-sleeping" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    assert "hostile-sleeping" in line, f"the sleeping check never started (rc {proc.poll()})"
    time.sleep(1)
    return proc, marker


def _stopped_by_sigterm(proc, marker, tmp_path) -> float:
    """SIGTERM to the run's process group (what a CI runner sends), a second one soon after (a
    runner that signals again, or the group and the process both), SIGKILL at GRACE_S: the run
    must be done by then, with partial reports and no process left. Returns the seconds it took."""
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        out, _ = proc.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running {GRACE_S} s after SIGTERM:\n{out[-3000:]}")
    took = time.monotonic() - start
    assert proc.returncode == 143, out[-3000:]  # 128 + SIGTERM
    (run,) = (tmp_path / "r" / "runs").iterdir()
    report = json.loads((run / "conformance.json").read_text())
    assert report["interrupted"] is True and report["signal"] == "SIGTERM", out[-3000:]
    assert report["summary"]["pass"] == 1, report["summary"]  # quick_sum ran before the sleeper
    assert (run / "conformance.md").exists() and (run / "conformance.xml").exists()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _processes_with_marker(marker):
        time.sleep(0.2)
    assert _processes_with_marker(marker) == [], "processes left behind after SIGTERM"
    return took


def test_sigterm_then_sigkill_partial_reports_within_the_grace_period(tmp_path):
    proc, marker = _start_sleeping_run(tmp_path, signal.SIG_DFL)
    took = _stopped_by_sigterm(proc, marker, tmp_path)
    print(f"SIGTERM to exit: {took:.2f} s")


def test_a_run_started_with_sigint_ignored_ignores_it_and_stops_on_sigterm(tmp_path):
    """A background job of a non-interactive shell (``cmd &``, nohup) inherits SIGINT ignored:
    Ctrl-C / ``kill -INT`` must not stop it (as with any Unix program), SIGTERM must."""
    proc, marker = _start_sleeping_run(tmp_path, signal.SIG_IGN)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(3)
    assert proc.poll() is None, "SIGINT stopped a run that was started with it ignored"
    assert len(_processes_with_marker(marker)) >= 3, "the workers went away on SIGINT"
    took = _stopped_by_sigterm(proc, marker, tmp_path)
    print(f"SIGTERM to exit (SIGINT ignored): {took:.2f} s")
