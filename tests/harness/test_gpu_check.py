"""tools/gpu_check.sh, the accelerator run (docs/gpu.md), on its CPU half with a tiny selection,
and its step runner: a failing or overrunning step is reported and the next one runs."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("tools_gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = sys.modules["tools_gpu_check"] = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_check)

TINY = {  # one layout case per implementation, the all-gather end to end and the paired area
    "GPU_CHECK_DEVICE": "cpu",
    "GPU_CHECK_IMPL": "reference,torch-fsdp2",
    "GPU_CHECK_K": "per_param_dim0_local_shard and 1d-dim0-uneven",
    "GPU_CHECK_PERF_K": "e2e or paired",
    "GPU_CHECK_BUDGET": "0.1",
    "GPU_CHECK_SIZES": "uneven:1",
    "GPU_CHECK_WORLD_SIZES": "2",
    "OMP_NUM_THREADS": "1",
}


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The data rows of the Markdown table whose header row, or the line above it, starts with
    ``heading``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading))
    rows = []
    for ln in lines[start + 1 :]:
        if ln.startswith("|"):
            if not ln.startswith("|---"):
                rows.append([c.strip() for c in ln.strip("|").split("|")])
        elif rows:
            break
    return rows if lines[start].startswith("|") else rows[1:]  # without the header row


def test_cpu_half_writes_every_report_and_a_summary_that_matches_them(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, **TINY, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=gpu_check.TOTAL_BUDGET + 60, env=env,
    )  # fmt: skip
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + summary
    assert f"torch {torch.__version__}" in summary and "`--device cpu`" in summary

    steps = {row[0]: row for row in _table_rows(summary, "| step |")}
    assert list(steps) == [
        "environment", "conformance-ws1", "conformance-multi", "perf-quick", "perf-timed",
    ]  # fmt: skip
    assert {row[1] for row in steps.values()} == {"ok"}, steps
    assert sum(float(row[2]) for row in steps.values()) <= gpu_check.TOTAL_BUDGET
    for name in steps:
        assert (out / f"{name}.log").stat().st_size > 0

    for name, sizes in (("conformance-ws1", [1]), ("conformance-multi", [2])):
        report = json.loads((out / name / "conformance.json").read_text())
        assert report["world_sizes"] == sizes
        assert {p["device"] for p in report["placement"].values()} == {"cpu"}
        counts = Counter((c["impl"], c["world_size"], c["outcome"]) for c in report["cases"])
        assert {impl for impl, _, _ in counts} == {"reference", "torch-fsdp2"}
        rows = _table_rows(summary, f"`{name}`: {len(report['cases'])} cases")
        for impl, ws, *cells, total in rows:
            expected = [counts[(impl, int(ws), o)] for o in gpu_check.OUTCOMES]
            assert [int(c) for c in cells] == expected, (name, impl, cells, expected)
            assert int(total) == sum(expected)
        assert len(rows) == 2

    assert list((out / "perf-quick").glob("perf-quick.md"))
    records = [b["extra_info"] for b in json.loads((out / "perf" / "perf.json").read_text())["benchmarks"]]  # fmt: skip
    ref = {
        (r["area"], r["path"]): r for r in records if r.get("impl") == "reference" and r.get("world_size") == 1
    }  # fmt: skip
    perf_rows = {(r[0], r[1]): r for r in _table_rows(summary, "| area | step |")}
    assert set(perf_rows) == {("allgather", "e2e"), ("paired", "full_sd"), ("paired", "unshard")}
    e2e = perf_rows[("allgather", "e2e")]
    assert e2e[5] == f"{ref[('allgather', 'e2e')]['vs_torch_fsdp2']:.2f}×"
    assert e2e[6] == f"{ref[('allgather', 'e2e')]['ratio_to_floor']:.2f}×"
    assert (
        perf_rows[("paired", "unshard")][5]
        == f"{ref[('paired', 'unshard')]['ratio_to_floor']:.2f}×"
    )


def test_a_failing_or_overrunning_step_is_reported_and_the_next_one_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "TERM_GRACE", 1.0)
    deadline = time.monotonic() + 60
    py = sys.executable
    steps = [
        gpu_check.Step("conformance-a", [py, "-c", "import sys; sys.exit(5)"], 30),
        gpu_check.Step("hangs", [py, "-c", "import time; print('up', flush=True); time.sleep(60)"], 3),
        gpu_check.Step("after", [py, "-c", "print('still ran')"], 30),
    ]  # fmt: skip
    for step in steps:
        gpu_check.run_step(step, tmp_path, dict(os.environ), deadline)
    assert steps[0].status == "failed: exit 5 (no case selected)" and not steps[0].ok
    assert re.fullmatch(r"timeout: stopped after 2 s \(exit -15\); partial", steps[1].status)
    assert steps[1].seconds < 10 and "up" in (tmp_path / "hangs.log").read_text()
    assert steps[2].ok and "still ran" in (tmp_path / "after.log").read_text()
    spent = gpu_check.Step("late", [py, "-c", "pass"], 30)
    gpu_check.run_step(spent, tmp_path, {}, time.monotonic() + 0.5)
    assert spent.status == "skipped: the 8-minute budget is spent"


def test_a_used_output_directory_is_refused(tmp_path, capsys):
    (tmp_path / "old.md").write_text("a previous run")
    assert gpu_check.main([str(tmp_path), "--device", "cpu"]) == 2
    assert "is not an empty directory; pass a new one" in capsys.readouterr().err
