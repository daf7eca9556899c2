"""Runner and CLI hardening (issue 12): bad input, poisoned groups, orphans, budgets, reports.

Each test drives ``python -m conformance`` the way a user or a misbehaving plug-in would.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness.test_cli import (
    FAKE_ON_SELFCHECKS,
    ROOT,
    run_conformance,
    sigint_as_in_a_terminal,
)

FAKE = "tests.harness.fake_impl:FakeImpl"


# ------------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--world-sizes", "a"], "--world-sizes: 'a' is not a number of ranks"),
        (["--world-sizes", "0"], "--world-sizes: '0' is not a number of ranks"),
        (["--world-sizes", ","], "--world-sizes: no world size given"),
        (["--check-timeout", "-5"], "--check-timeout: '-5' is not a number of seconds > 0"),
        (["--check-timeout", "0"], "--check-timeout: '0' is not a number of seconds > 0"),
        (["--check-timeout", "nan"], "--check-timeout: 'nan' is not a number of seconds > 0"),
        (["--check-timeout", "inf"], "--check-timeout: 'inf' is not a number of seconds > 0"),
        (["--check-timeout", "abc"], "--check-timeout: 'abc' is not a number of seconds > 0"),
        (["--grace", "-1"], "--grace: '-1' is not a number of seconds >= 0"),
        (["--threads-per-rank", "0"], "--threads-per-rank: '0' is not a whole number >= 1"),
        (["--device", "nosuchdevice"], "--device: 'nosuchdevice' is not a device type"),
        (["--backend", "nosuch"], "--backend: unknown backend 'nosuch'"),
        (
            ["--expectations-dir", "/no/such/dir"],
            "--expectations-dir: '/no/such/dir' does not exist",
        ),
        (["--check-dir", "/no/such/dir"], "--check-dir: '/no/such/dir' does not exist"),
        (["--impl", ""], "--impl: no implementation given"),
        (["--impl", " , "], "--impl: no implementation given"),
        (
            ["--impl", "tests.harness.fake_impl:VersionRaises"],
            "--impl: implementation 'tests.harness.fake_impl:VersionRaises' (VersionRaises) is "
            "not a valid adapter: reading its version raised RuntimeError: no version today",
        ),
    ],
)
def test_bad_option_is_one_line_and_exit_2_before_anything_runs(tmp_path, args, expected):
    proc = run_conformance(*args, "--reports-dir", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("fsdp conformance: "), lines
    assert expected in lines[0] and "; " in lines[0], lines  # what is wrong; what to change
    assert not (tmp_path / "r").exists()  # nothing ran, nothing written


def test_device_without_hardware_is_a_usage_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_conformance("--device", "cuda", "--reports-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "--device: no cuda device is available here" in proc.stderr, proc.stderr


@pytest.mark.parametrize("make", ["file", "under-a-file"])
def test_unwritable_reports_dir_is_found_before_the_run(tmp_path, make):
    (tmp_path / "f").write_text("a file")
    target = tmp_path / "f" if make == "file" else tmp_path / "f" / "sub"
    proc = run_conformance(*FAKE_ON_SELFCHECKS, "--reports-dir", str(target), "-k", "passes")
    assert proc.returncode == 2 and "--reports-dir: " in proc.stderr, proc.stderr
    assert "passed" not in proc.stdout


def test_world_sizes_above_the_cpu_count_warn_with_the_slowdown(tmp_path):
    ws = (os.cpu_count() or 1) * 2
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", str(ws), "--collect-only", "-q",
        "--reports-dir", str(tmp_path / "r"),
    )  # fmt: skip
    assert proc.returncode in (0, 5), proc.stderr
    assert f"WARNING world size {ws} on {os.cpu_count()} CPU core(s)" in proc.stderr
    assert "2.0x longer" in proc.stderr


# ------------------------------------------------------------------------------ groups, budgets
def test_a_rank_leaving_a_collective_pending_does_not_poison_the_next_check(tmp_path):
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "--check-timeout", "20", "-k",
        "leaves_all_reduce_pending or independent_after_pending", "--reports-dir", str(tmp_path),
    )  # fmt: skip
    cases = {
        c["check"]: c for c in json.loads((tmp_path / "conformance.json").read_text())["cases"]
    }
    assert cases["leaves_all_reduce_pending"]["outcome"] == "fail", proc.stdout
    after = cases["independent_after_pending"]
    assert after["outcome"] == "pass", after["message"]


def test_a_check_budget_is_a_multiple_of_check_timeout_and_says_so(tmp_path):
    """``sleeps`` declares 120 s (2x the default 60 s): under --check-timeout 2 it gets 4 s."""
    start = time.monotonic()
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "--check-timeout", "2", "-k", "sleeps",
        "--reports-dir", str(tmp_path),
    )  # fmt: skip
    (case,) = json.loads((tmp_path / "conformance.json").read_text())["cases"]
    assert case["outcome"] == "fail", proc.stdout
    assert "did not finish within 4 s (2 x --check-timeout 2)" in case["message"]
    assert case["duration_s"] < 20 and time.monotonic() - start < 120
    assert all(r["duration_s"] >= 4 for r in case["ranks"]), case["ranks"]  # real elapsed time


def test_a_hung_save_job_is_bounded_by_check_timeout_and_reports_its_stack(tmp_path):
    proc = run_conformance(
        "--impl", "tests.harness.fake_impl:HangingSave", "--world-sizes", "1",
        "--check-timeout", "10", "-k", "reshard_dcp and from-ws1", "--reports-dir", str(tmp_path),
    )  # fmt: skip
    (case,) = json.loads((tmp_path / "conformance.json").read_text())["cases"]
    assert case["outcome"] == "fail", proc.stdout
    assert case["duration_s"] < 10 * 260 / 60 + 5, case["duration_s"]  # the check's budget
    assert "save job did not finish in time" in case["message"]
    assert "fake_impl.py" in case["message"] and "hanging_state_dict" in case["message"]


# ------------------------------------------------------------------------------ reports
def test_collect_only_writes_no_reports(tmp_path):
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS, "--collect-only", "--reports-dir", str(tmp_path / "r")
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "r").exists()


def test_reports_keep_every_run_and_the_cause_of_a_long_message(tmp_path):
    # as the conformance nox session starts it: the rerun line says nox and carries its variables
    env = {"FSDP_CONFORMANCE_TORCH": "torch==9.9.9", "FSDP_CONFORMANCE_LAUNCHER": "nox"}
    exp = tmp_path / "exp"
    exp.mkdir()
    first = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "long_failure", "--check-timeout", "30",
        "--expectations-dir", str(exp), "--reports-dir", str(tmp_path / "r"), env=env,
    )  # fmt: skip
    assert first.returncode == 1, first.stdout + first.stderr
    second = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "selftest and passes",
        "--reports-dir", str(tmp_path / "r"),
    )  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    runs = sorted((tmp_path / "r" / "runs").iterdir())
    assert len(runs) == 2 and all((d / "conformance.json").exists() for d in runs)
    latest = json.loads((tmp_path / "r" / "conformance.json").read_text())
    assert [c["check"] for c in latest["cases"]] == ["passes"]  # the top level is the latest
    older = [json.loads((d / "conformance.json").read_text()) for d in runs]
    (case,) = next(doc for doc in older if doc["cases"][0]["check"] == "long_failure")["cases"]
    assert case["message"].rstrip().endswith("THE-REAL-CAUSE-AT-THE-END") or (
        "THE-REAL-CAUSE-AT-THE-END" in case["message"][-2000:]
    )
    assert len(case["message"]) < 25000 and "characters cut" in case["message"]
    repro = case["repro"]
    for part in (
        "FSDP_CONFORMANCE_TORCH=torch==9.9.9 nox -s conformance --",
        f"--impl {FAKE}", "--world-sizes 2", "--device cpu", "--backend gloo",
        "--check-timeout 30", f"--expectations-dir {exp}", "--check-dir tests/harness/selfchecks",
    ):  # fmt: skip
        assert part in repro, repro
    assert not list((tmp_path / "r").glob(".*.tmp")), "a temporary report file was left"


# ------------------------------------------------------------------------------ signals, orphans
def _processes_with_marker(marker: str) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found[int(entry.name)] = (
                        (entry / "cmdline").read_bytes().decode(errors="replace")
                    )
        except OSError:
            continue
    return found


def _start(tmp_path, *args):
    marker = f"FSDP_SELFTEST_MARKER={os.getpid()}_{time.time_ns()}"
    key, value = marker.split("=")
    proc = subprocess.Popen(
        [sys.executable, "-m", "conformance", *args, "--reports-dir", str(tmp_path / "r")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, key: value}, start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    return proc, marker


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_sigterm_ends_the_run_like_ctrl_c_and_writes_the_reports(tmp_path):
    proc, marker = _start(tmp_path, *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "sleeps", "-s")
    assert _wait_for(lambda: len(_processes_with_marker(marker)) >= 3, 120)
    time.sleep(3)  # the workers reach the check
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    (run,) = (tmp_path / "r" / "runs").iterdir()
    doc = json.loads((run / "conformance.json").read_text())
    assert (doc["interrupted"], doc["signal"], doc["cases_run"]) == (True, "SIGTERM", 0), out
    assert doc["cases_not_run"] == 1 and "INTERRUPTED by SIGTERM" in out
    assert not (tmp_path / "r" / "conformance.json").exists()  # no finished run yet
    assert _wait_for(lambda: not _processes_with_marker(marker), 15), "processes left after SIGTERM"


def test_an_interrupted_run_is_marked_and_is_not_the_latest_finished_run(tmp_path):
    """Ctrl-C after some cases: the run's own reports say interrupted, with the cases run and not
    run (JSON, md, terminal); the top-level files stay the previous finished run's."""
    reports = tmp_path / "r"
    finished = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "selftest and passes",
        "--reports-dir", str(reports),
    )  # fmt: skip
    assert finished.returncode == 0, finished.stdout + finished.stderr
    names = ("conformance.json", "conformance.md", "conformance.xml")
    before = {name: (reports / name).read_bytes() for name in names}
    (first,) = (reports / "runs").iterdir()

    proc, marker = _start(
        tmp_path, *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-s",
        "-k", "selftest and (passes or fails_on_rank1 or needs_hsdp or sleeps)",
    )  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")))
    reader.start()
    # "sleeps", the last of the four, prints this once its workers are in it: three cases ran
    assert _wait_for(lambda: any("selftest-sleeping" in ln for ln in output), 120), output
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    proc.wait(timeout=60)
    reader.join(timeout=10)
    out = "".join(output)
    assert proc.returncode == 128 + signal.SIGINT, out

    (run,) = [d for d in (reports / "runs").iterdir() if d != first]
    doc = json.loads((run / "conformance.json").read_text())
    assert (doc["interrupted"], doc["signal"]) == (True, "SIGINT"), out
    assert (doc["cases_run"], doc["cases_not_run"]) == (3, 1), out
    outcomes = sorted(c["outcome"] for c in doc["cases"])
    assert outcomes == ["fail", "not-supported", "pass"], outcomes  # what ran, as it ran
    assert "INTERRUPTED by SIGINT: 3 case(s) ran, 1 did not run" in out, out
    assert (
        "INTERRUPTED by SIGINT: 3 case(s) ran, 1 did not run"
        in ((run / "conformance.md").read_text().splitlines()[2])
    )
    assert not (run / ".running").exists()
    after = {name: (reports / name).read_bytes() for name in names}
    assert after == before  # still the latest *finished* run


def test_sigkill_of_the_driver_takes_the_workers_and_the_save_job_with_it(tmp_path):
    proc, marker = _start(
        tmp_path, "--impl", "tests.harness.fake_impl:HangingSave", "--world-sizes", "1",
        "-k", "reshard_dcp and from-ws1",
    )  # fmt: skip

    def save_job_running():  # the save-job server and at least one job rank (forked from it)
        cmdlines = _processes_with_marker(marker).values()
        return sum("state_dict.reshard" in c for c in cmdlines) >= 2

    assert _wait_for(save_job_running, 120), "the save job never started"
    time.sleep(1)
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait_for(lambda: not _processes_with_marker(marker), 10), _processes_with_marker(marker)


def test_sigkill_of_the_driver_during_group_start_up_leaves_no_worker(tmp_path):
    proc, marker = _start(
        tmp_path, *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "selftest and passes"
    )
    assert _wait_for(lambda: len(_processes_with_marker(marker)) >= 2, 120)
    proc.kill()  # the forkserver is still importing torch, or the workers are joining the group
    proc.communicate(timeout=30)
    # (before the fix they lived on for 20-26 s; 10 s leaves room for a loaded machine)
    assert _wait_for(lambda: not _processes_with_marker(marker), 10), _processes_with_marker(marker)


def test_temporary_directories_are_removed(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS, "--world-sizes", "2", "-k", "selftest and (passes or exits_on_rank1)",
        "--reports-dir", str(tmp_path / "r"), env={"TMPDIR": str(tmp)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout  # exits_on_rank1 forces a respawn
    assert list(tmp.glob("fsdp-conformance-*")) == []


def test_under_torchrun_a_hung_rank_stack_reaches_the_terminal_whatever_the_capture(tmp_path):
    from tests.harness.test_cli import _free_port

    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_free_port()), "-m", "conformance", *FAKE_ON_SELFCHECKS,
            "-k", "selftest and deadlocks", "--grace", "1", "--reports-dir", str(tmp_path / "r"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # 4 s budget + 1 s grace, then the in-process watchdog dumps the stuck rank's stack to the
    # stderr the process started with and stops the run (docs/multi-node.md, exit code 6)
    assert "rank 1 stuck in the check past its budget + --grace" in out, out[-3000:]
    assert "selftest.py" in out and "in deadlocks" in out, out[-3000:]  # rank 1's frame
