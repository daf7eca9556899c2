"""``python -m conformance diff``: outcome changes between two hand-made conformance.json reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import diff

ROOT = Path(__file__).resolve().parents[2]


def case(case_id: str, outcome: str, impl: str = "reference", message: str = "") -> dict:
    area, rest = case_id.split("::")
    return {
        "id": case_id,
        "area": area,
        "check": rest.split("[")[0],
        "impl": impl,
        "world_size": int(rest.split("[ws")[1][0]),
        "outcome": outcome,
        "message": message,
    }


def report(cases, torch="2.13.0", versions=None) -> dict:
    versions = versions or {"reference": "project reference, on torch " + torch}
    return {
        "tool": "fsdp-conformance",
        "created": "2026-01-01T00:00:00Z",
        "torch": torch,
        "python": "3.11.7",
        "implementations": [
            {"spec": n, "name": n, "version": v, "capabilities": []} for n, v in versions.items()
        ],
        "cases": cases,
    }


# how a strict XPASS (a listed expected failure that passed) is recorded: outcome "fail"
XPASS_MESSAGE = (
    "[XPASS(strict)] FSDP1 FULL offload_to_cpu keeps GPU tensors "
    "[conformance/expectations/torch-fsdp1.txt:12; raises=AssertionError match=/on cpu/]"
)
OLD = report(
    [
        case("layout::a[ws2]", "pass"),
        case("layout::b[ws2]", "fail"),
        case("layout::c[ws2]", "pass"),
        case("layout::d[ws2]", "pass"),
        case("layout::e[ws2]", "xfail"),
        case("layout::f[ws2]", "xfail"),
        case("layout::g[ws2]", "pass"),
        case("layout::gone[ws2]", "pass"),
        case("layout::a[ws2]", "pass", impl="torch-fsdp2"),
    ]
)
NEW = report(
    [
        case(
            "layout::a[ws2]",
            "fail",
            message="Traceback\nAssertionError: [rank 1/2] rows 3:5 != 2:4",
        ),
        case("layout::b[ws2]", "pass"),
        case("layout::c[ws2]", "xfail"),
        case("layout::d[ws2]", "not-supported"),
        case("layout::e[ws2]", "pass"),
        case("layout::f[ws2]", "fail", message=XPASS_MESSAGE),
        case("layout::g[ws2]", "fail", message=XPASS_MESSAGE),
        case("layout::new[ws2]", "fail"),
        case("layout::a[ws2]", "pass", impl="torch-fsdp2"),
    ],
    torch="2.14.0",
)


def ids(changes):
    return [(c.impl, c.case_id, c.old, c.new) for c in changes]


def test_compare_sorts_every_kind_of_change():
    d = diff.compare(OLD, NEW)
    assert ids(d.new_failures) == [
        ("reference", "layout::a[ws2]", "pass", "fail"),
        ("reference", "layout::new[ws2]", None, "fail"),
    ]
    assert d.new_failures[0].message == "AssertionError: [rank 1/2] rows 3:5 != 2:4"
    assert ids(d.fixed) == [
        ("reference", "layout::b[ws2]", "fail", "pass"),
        ("reference", "layout::e[ws2]", "xfail", "pass"),
        ("reference", "layout::f[ws2]", "xfail", "xpass"),  # an expected failure now passes
    ]
    assert "entry in conformance/expectations/torch-fsdp1.txt:12" in d.fixed[2].message
    assert ids(d.new_xfails) == [("reference", "layout::c[ws2]", "pass", "xfail")]
    assert ids(d.changed) == [
        ("reference", "layout::d[ws2]", "pass", "not-supported"),
        ("reference", "layout::g[ws2]", "pass", "xpass"),  # an entry for a case that passed
    ]
    assert ids(d.vanished) == [("reference", "layout::gone[ws2]", "pass", None)]
    assert d.appeared == []  # a new case that fails is listed once, as a new failure
    assert d.unchanged == 1  # torch-fsdp2's layout::a: the same case id on another implementation
    assert ("torch", "2.13.0", "2.14.0") in d.versions
    assert (
        "implementation reference",
        "project reference, on torch 2.13.0",
        "project reference, on torch 2.14.0",
    ) in d.versions


def test_appeared_case_that_passes():
    d = diff.compare(report([]), report([case("states::x[ws1]", "pass")]))
    assert ids(d.appeared) == [("reference", "states::x[ws1]", None, "pass")] and not d.new_failures


def _run(tmp_path, old, new, *args):
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "diff",
            str(tmp_path / "old.json"),
            str(tmp_path / "new.json"),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_text_and_exit_status_one_on_new_failures(tmp_path):
    proc = _run(tmp_path, OLD, NEW)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert "New failures (2):" in out and "layout::a[ws2] on reference: pass -> fail" in out
    assert (
        "Fixed (3):" in out and "Vanished (1):" in out and "version torch: 2.13.0 -> 2.14.0" in out
    )
    assert "layout::f[ws2] on reference: xfail -> xpass (expected failure passed" in out


def test_cli_xpass_alone_is_a_fix_and_exits_zero(tmp_path):
    old = report([case("strict::x[ws2]", "xfail"), case("strict::y[ws2]", "xfail")])
    new = report(
        [case("strict::x[ws2]", "fail", message=XPASS_MESSAGE), case("strict::y[ws2]", "xfail")],
        torch="2.14.1",
    )
    proc = _run(tmp_path, old, new)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "New failures" not in proc.stdout and "Fixed (1):" in proc.stdout, proc.stdout
    assert "0 new failures, 1 fixed" in proc.stdout


def test_cli_markdown_to_file_and_exit_zero_without_new_failures(tmp_path):
    old = report([case("layout::b[ws2]", "fail")])
    new = report([case("layout::b[ws2]", "pass")])
    proc = _run(tmp_path, old, new, "--markdown", "--output", str(tmp_path / "diff.md"))
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "diff.md").read_text()
    assert md == proc.stdout
    assert "## Fixed (1)" in md and "| `layout::b[ws2]` | reference | fail | pass |" in md


@pytest.mark.parametrize("content", ["not json", json.dumps({"no": "cases"})])
def test_cli_unreadable_report_exits_two_and_says_what_to_pass(tmp_path, content):
    (tmp_path / "bad.json").write_text(content)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "diff",
            str(tmp_path / "bad.json"),
            str(tmp_path / "bad.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "bad.json" in proc.stderr and "report" in proc.stderr


def test_cli_warns_when_a_report_is_partial(tmp_path):
    old = report([case("layout::b[ws2]", "pass"), case("layout::c[ws2]", "pass")])
    new = report([case("layout::b[ws2]", "pass")]) | {"interrupted": True, "signal": "SIGINT"}
    proc = _run(tmp_path, old, new)
    assert "new.json is a partial report (INTERRUPTED by SIGINT" in proc.stderr, proc.stderr
    assert "(INTERRUPTED by SIGINT: partial;" in proc.stdout.splitlines()[1], proc.stdout
    quiet = _run(tmp_path, old, report([case("layout::b[ws2]", "pass")]))
    assert "partial" not in quiet.stderr + quiet.stdout
