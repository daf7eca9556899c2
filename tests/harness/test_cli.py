"""The conformance command end to end: plug-in loading, expectations, reports, Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.reporting import python_command

ROOT = Path(__file__).resolve().parents[2]
SELFCHECKS = "tests/harness/selfchecks"
# The fake implementation on the harness self-test checks (instead of the real check areas).
FAKE_ON_SELFCHECKS = ["--impl", "tests.harness.fake_impl:FakeImpl", "--check-dir", SELFCHECKS]


def run_conformance(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("no-such-impl", "unknown implementation 'no-such-impl'"),
        ("no_such_package.adapters:Impl", "ModuleNotFoundError"),
        ("tests.harness.fake_impl:broken", "this factory is broken on purpose"),
        ("tests.harness.fake_impl:NoSuchAttr", "AttributeError"),
    ],
)
def test_bad_impl_stops_the_run_before_anything_executes(tmp_path, spec, expected):
    proc = run_conformance(
        "--impl", spec, "--reports-dir", str(tmp_path / "r"), "--world-sizes", "1"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert spec in out and expected in out, out
    assert "passed" not in out and not (tmp_path / "r").exists()


def test_bad_impl_from_environment_variable(tmp_path):
    proc = run_conformance(
        "--reports-dir",
        str(tmp_path / "r"),
        "--world-sizes",
        "1",
        env={"FSDP_CONFORMANCE_IMPL": "no_such_package:X"},
    )
    assert proc.returncode == 2 and "no_such_package:X" in proc.stdout + proc.stderr


def test_entry_point_plugin_of_an_installed_distribution(tmp_path):
    """A vendor's package declares ``fsdp_conformance.implementations``; ``--impl <name>`` finds
    it (in the driver and in the spawned ranks) and its checks run under that name."""
    dist_info = tmp_path / "site" / "fsdp_fake_vendor-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fsdp-fake-vendor\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[fsdp_conformance.implementations]\nfake-vendor = tests.harness.fake_impl:FakeImpl\n"
    )
    path = os.pathsep.join([str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = run_conformance(
        "--impl",
        "fake-vendor",
        "--check-dir",
        SELFCHECKS,
        "--world-sizes",
        "2",
        "--reports-dir",
        str(tmp_path / "r"),
        "-k",
        "selftest and passes",
        env={"PYTHONPATH": path},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    report = json.loads((tmp_path / "r" / "conformance.json").read_text())
    ran = [(c["check"], c["impl"], c["outcome"]) for c in report["cases"]]
    assert ran and all(impl == "fake" and outcome == "pass" for _, impl, outcome in ran), ran
    # the rerun line carries the distribution's directory (ROOT, the directory the run started
    # in, needs none) and reruns the case in an environment without PYTHONPATH
    repro = report["cases"][0]["repro"]
    python = python_command()  # "python", or this interpreter's path when another one is first
    assert repro.startswith(
        f"PYTHONPATH={(tmp_path / 'site').resolve()} {python} -m conformance --impl fake-vendor "
    ), repro
    assert report["command"].startswith(f"PYTHONPATH={(tmp_path / 'site').resolve()} {python} -m")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    again = subprocess.run(
        ["bash", "-c", f"{repro} --reports-dir {tmp_path / 'r2'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    (case,) = json.loads((tmp_path / "r2" / "conformance.json").read_text())["cases"]
    assert (case["id"], case["impl"], case["outcome"]) == (report["cases"][0]["id"], "fake", "pass")


def test_expectation_without_reason_is_rejected(tmp_path):
    (tmp_path / "fake.txt").write_text("selftest::passes\n")
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS,
        "--expectations-dir",
        str(tmp_path),
        "--world-sizes",
        "2",
    )
    assert proc.returncode == 2 and "has no reason" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def selftest_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("selftest")
    (tmp / "exp").mkdir()
    (tmp / "exp" / "fake.txt").write_text(
        "# expected failures for the self-test\n"
        "selftest::fails_on_rank1   rank 1 is wrong on purpose\n"
        "selftest::passes           listed although it passes: an unexpected pass must fail the run\n"
        "selftest::no_such_check    matches nothing: must be reported stale\n"
    )
    start = time.monotonic()
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS,
        "--expectations-dir",
        str(tmp / "exp"),
        "--world-sizes",
        "2",
        "--reports-dir",
        str(tmp / "reports"),
        "-k",
        "selftest and not sleeps",
    )
    report = json.loads((tmp / "reports" / "conformance.json").read_text())
    cases = {c["check"]: c for c in report["cases"]}
    return proc, report, cases, tmp, time.monotonic() - start


def test_outcomes(selftest_run):
    proc, report, cases, _, _ = selftest_run
    assert proc.returncode == 1, proc.stdout
    assert cases["fails_on_rank1"]["outcome"] == "xfail"
    assert cases["passes"]["outcome"] == "fail" and "XPASS" in cases["passes"]["message"]
    assert cases["needs_hsdp"]["outcome"] == "not-supported"
    assert "hsdp" in cases["needs_hsdp"]["message"]
    assert cases["exits_on_rank1"]["outcome"] == "fail"
    assert "exited with code 7" in cases["exits_on_rank1"]["message"]


def test_deadlock_case_has_both_stacks_and_is_bounded(selftest_run):
    _, _, cases, _, _ = selftest_run
    dead = cases["deadlocks"]
    assert dead["outcome"] == "fail"
    assert dead["duration_s"] < 4 + 5, dead["duration_s"]
    ranks = {r["rank"]: r for r in dead["ranks"]}
    assert ranks[1]["status"] == "timeout" and "selftest.py" in ranks[1]["detail"]
    assert "stack at teardown" in ranks[0]["detail"]


def test_checks_after_a_crash_still_run(selftest_run):
    _, _, cases, _, _ = selftest_run
    # the file's checks run in definition order: 'needs_hsdp' and 'sleeps' come after the crash
    assert cases["exits_on_rank1"]["outcome"] == "fail" and cases["needs_hsdp"]["outcome"]


def test_stale_entry_warned_and_reports_written(selftest_run):
    proc, report, cases, tmp, _ = selftest_run
    assert "stale expectation 'selftest::no_such_check'" in proc.stdout
    assert [e["prefix"] for e in report["stale_expectations"]] == ["selftest::no_such_check"]
    for name in ("conformance.json", "conformance.md", "conformance.xml"):
        assert (tmp / "reports" / name).stat().st_size > 0
    assert report["implementations"][0]["name"] == "fake"
    assert report["torch"] and report["wall_time_s"] > 0 and report["world_sizes"] == [2]
    for case in cases.values():  # a python -m run is rerun with python -m (not nox)
        assert case["repro"].startswith(
            f"{python_command()} -m conformance --impl tests.harness.fake_impl:FakeImpl"
        ), case["repro"]
        assert case["nodeid"] in case["repro"]
    assert "FSDP conformance matrix" in proc.stdout and "selftest" in proc.stdout
    assert report["interrupted"] is False and report["signal"] is None
    assert (report["cases_run"], report["cases_not_run"]) == (len(cases), 0)


PYTEST_WORDS = {"passed": "pass", "failed": "fail", "xfailed": "xfail", "skipped": "skip"}


def test_pytest_closing_line_counts_what_the_matrix_counts(selftest_run):
    """pytest's last line and the matrix's total tell one story: not-supported cases are their
    own count in both (pytest's "skipped" is only the other skips)."""
    proc, report, _, _, _ = selftest_run
    lines = proc.stdout.splitlines()
    total = next(ln for ln in lines if ln.startswith("total: "))
    matrix = {o: int(n) for n, o in (part.split() for part in total[7:].split(", "))}
    closing = re.search(r"=+ (.*) in [\d.]+s", lines[-1]).group(1)
    counts = dict(part.split(" ", 1)[::-1] for part in closing.split(", "))
    pytest_counts = {PYTEST_WORDS.get(k, k): int(v) for k, v in counts.items() if k != "deselected"}
    assert pytest_counts == matrix, (lines[-1], total)
    assert matrix["not-supported"] == 1 and report["summary"]["not-supported"] == 1


def _processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT back to its default disposition. A job started in the
    background of a non-interactive shell (``cmd &``, as CI runners and ``nohup`` launches do)
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the Ctrl-C
    these tests send would be ignored and they would wait for the sleeping check to end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_worker_behind(tmp_path):
    marker = f"FSDP_SELFTEST_MARKER={os.getpid()}_{time.time_ns()}"
    key, value = marker.split("=")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            *FAKE_ON_SELFCHECKS,
            "--world-sizes",
            "2",
            "-k",
            "sleeps",
            "-s",
            "--reports-dir",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, key: value},
        start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,  # a background launch inherits SIGINT ignored
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_processes_with_marker(marker)) < 3:
        time.sleep(0.5)
    time.sleep(3)  # let the workers reach the check
    assert len(_processes_with_marker(marker)) >= 3, "driver and two workers never appeared"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out  # 128 + SIGINT (docs/running.md, "Exit codes and signals")
    (run,) = (tmp_path / "r" / "runs").iterdir()  # the partial reports are written there
    assert json.loads((run / "conformance.json").read_text())["interrupted"] is True, out
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _processes_with_marker(marker):
        time.sleep(0.5)
    assert _processes_with_marker(marker) == [], "processes left behind after Ctrl-C"


def test_under_torchrun_checks_run_in_process_and_rank0_reports(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "conformance",
            *FAKE_ON_SELFCHECKS,
            "-k",
            "selftest and (passes or fails_on_rank1 or needs_hsdp)",
            "--reports-dir",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((tmp_path / "r" / "conformance.json").read_text())
    outcomes = {c["check"]: c["outcome"] for c in report["cases"]}
    assert report["torchrun"] and report["world_sizes"] == [2]
    assert outcomes == {"passes": "pass", "fails_on_rank1": "fail", "needs_hsdp": "not-supported"}
    failing = next(c for c in report["cases"] if c["check"] == "fails_on_rank1")
    assert "expected 0, got 1" in failing["message"]  # rank 1's assertion reached rank 0's report
    assert proc.stdout.count("FSDP conformance matrix") == 1  # only rank 0 prints the matrix


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
