"""Torch versions: the supported-range warning and the cross-version matrix over hand-made
conformance.json reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import versions

ROOT = Path(__file__).resolve().parents[2]


def case(case_id: str, outcome: str, impl: str = "torch-fsdp1", message: str = "") -> dict:
    return {"id": case_id, "impl": impl, "outcome": outcome, "message": message}


def report(torch: str, cases: list[dict], wall: float = 200.0) -> dict:
    return {
        "tool": "fsdp-conformance",
        "torch": torch,
        "created": "2026-12-02T00:00:00Z",
        "command": "python -m conformance",
        "wall_time_s": wall,
        "world_sizes": [1, 2],
        "implementations": [{"name": "torch-fsdp1"}, {"name": "reference"}],
        "cases": cases,
    }


XPASS = "[XPASS(strict)] offload_to_cpu broken [torch-fsdp1.txt:9; raises=AssertionError]"
R212 = report(
    "2.12.1+cu130",
    [
        case("state_dict::full[ws2-offload]", "xfail", message="expected failure: offload"),
        case("wrap::mp_warning[ws2-never]", "pass"),
        case("layout::rows[ws2]", "pass"),
        case("layout::rows[ws2]", "pass", impl="reference"),
        case("fuzz::layout[ws2]", "not-supported", impl="reference"),
    ],
    wall=300.0,
)
R213 = report(
    "2.13.0+cpu",
    [
        case("state_dict::full[ws2-offload]", "xfail", message="expected failure: offload"),
        case("wrap::mp_warning[ws2-never]", "pass"),
        case("layout::rows[ws2]", "pass"),
        case("layout::rows[ws2]", "pass", impl="reference"),
        case("fuzz::layout[ws2]", "not-supported", impl="reference"),
        case("layout::new_check[ws2]", "pass"),
    ],
)
R214 = report(
    "2.14.1+cu130",
    [
        case("state_dict::full[ws2-offload]", "fail", message=XPASS),
        case(
            "wrap::mp_warning[ws2-never]",
            "fail",
            message="Traceback\nAssertionError: [rank 0/2] warned although nothing is wrapped",
        ),
        case("layout::rows[ws2]", "pass"),
        case("layout::rows[ws2]", "skip", impl="reference", message="skipped: no reason"),
        case("fuzz::layout[ws2]", "not-supported", impl="reference"),
        case("layout::new_check[ws2]", "pass"),
    ],
)


def test_matrix_lists_exactly_the_cases_whose_outcome_differs():
    doc = versions.matrix(
        [(Path(f"{t}/conformance.json"), r) for t, r in ((212, R212), (213, R213), (214, R214))]
    )
    labels = [v["label"] for v in doc["versions"]]
    assert labels == ["2.12.1+cu130", "2.13.0+cpu", "2.14.1+cu130"]
    totals = {v["label"]: v["totals"] for v in doc["versions"]}
    assert totals["2.12.1+cu130"] == {
        "pass": 3,
        "xfail": 1,
        "fail": 0,
        "skip": 0,
        "not-supported": 1,
    }
    assert totals["2.14.1+cu130"] == {
        "pass": 2,
        "xfail": 0,
        "fail": 2,
        "skip": 1,
        "not-supported": 1,
    }
    changed = {(c["impl"], c["id"]): c["outcomes"] for c in doc["changed"]}
    assert changed == {
        ("torch-fsdp1", "state_dict::full[ws2-offload]"): dict(
            zip(labels, ["xfail", "xfail", "xpass"])
        ),
        ("torch-fsdp1", "wrap::mp_warning[ws2-never]"): dict(zip(labels, ["pass", "pass", "fail"])),
        ("reference", "layout::rows[ws2]"): dict(zip(labels, ["pass", "pass", "skip"])),
    }
    # a case the older run did not have is not a change of behaviour
    assert doc["partial"] == [
        {
            "impl": "torch-fsdp1",
            "id": "layout::new_check[ws2]",
            "outcomes": dict(zip(labels, [None, "pass", "pass"])),
        }
    ]
    assert doc["unchanged"] == 2  # torch-fsdp1 layout::rows, reference fuzz::layout
    by_id = {c["id"]: c for c in doc["changed"]}
    assert by_id["wrap::mp_warning[ws2-never]"]["messages"] == {
        "2.14.1+cu130": "AssertionError: [rank 0/2] warned although nothing is wrapped"
    }
    assert by_id["state_dict::full[ws2-offload]"]["messages"] == {
        label: "expected failure: offload" for label in labels[:2]
    }

    md = versions.markdown(doc)
    assert "| 2.12.1+cu130 | 3 | 1 | 0 | 0 | 1 | 300 s |" in md
    assert "| `wrap::mp_warning[ws2-never]` | torch-fsdp1 | pass | pass | fail |" in md
    assert "new_check" not in md.split("other cases")[0]
    assert "1 cases are not in every report" in md and "2.12.1+cu130 1, 2.13.0+cpu 0" in md
    assert "## Cases whose outcome differs between versions (3)" in md


def test_matrix_of_identical_runs_says_none_differ_and_keeps_two_builds_of_one_torch_apart():
    doc = versions.matrix([(Path("a.json"), R213), (Path("b.json"), R213)])
    assert [v["label"] for v in doc["versions"]] == ["2.13.0+cpu", "2.13.0+cpu (2)"]
    assert doc["changed"] == [] and doc["unchanged"] == 6
    assert "None: all 6 cases in every report have the same outcome." in versions.markdown(doc)


def test_cli_writes_md_and_json_and_rejects_a_non_report(tmp_path):
    paths = []
    for name, doc in (("a", R212), ("b", R214)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "conformance.versions", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(
        cmd + [str(p) for p in paths], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "out" / "versions.json").read_text())
    assert [v["label"] for v in written["versions"]] == ["2.12.1+cu130", "2.14.1+cu130"]
    assert len(written["changed"]) == 3 and len(written["partial"]) == 1
    assert (tmp_path / "out" / "versions.md").read_text() == proc.stdout
    (tmp_path / "bad.json").write_text(json.dumps({"no": "cases"}))
    bad = subprocess.run(
        cmd + [str(tmp_path / "bad.json")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (
        bad.returncode == 2
        and "bad.json" in bad.stderr
        and "not a conformance report" in bad.stderr
    )


@pytest.mark.parametrize(
    "version, inside",
    [
        ("2.10.2", False),
        ("2.11.0", True),
        ("2.12.1+cu130", True),
        ("2.13.0+cpu", True),
        ("2.14.1", True),
        ("2.14.9", True),
        ("2.15.0.dev20261201", False),
        ("2.15.0", False),
    ],
)
def test_support_warning_only_outside_the_range(version, inside):
    warning = versions.support_warning(version)
    if inside:
        assert warning is None
    else:
        assert f"torch {version} is outside the supported range {versions.SUPPORTED}" in warning
        assert "\n" not in warning


def test_a_run_on_a_torch_outside_the_range_says_so_in_one_line_at_start(tmp_path):
    """The driver's torch reports a version above the range (set by a sitecustomize before the
    run starts); the run prints the one warning line and goes on (collect-only here)."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.99.0'\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "--impl",
            "tests.harness.fake_impl:FakeImpl",
            "--check-dir",
            "tests/harness/selfchecks",
            "--world-sizes",
            "2",
            "-k",
            "selftest and passes",
            "--collect-only",
            "-q",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in out.splitlines() if "outside the supported range" in ln]
    assert lines == [versions.support_warning("2.99.0")], out
