"""The fuzz area finds a deliberately broken fork and prints a reproducer that fails on its own,
while the same reproducer passes against the unbroken implementation.

``SummingFork`` is the reference FSDP2 with one rule broken in every process that loads it: the
gradient reduce-scatter sums over the ranks instead of averaging (P6), which only shows when
training at world size >= 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.adapters import FullyShardAdapter
from conformance.adapters.registry import load_implementation
from conformance.fuzz import model as fm
from conformance.fuzz import strategies as fs

ROOT = Path(__file__).resolve().parents[2]
FORK = "tests.harness.test_fuzz:SummingFork"


def _summing_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, factor):
    from torch.distributed import ReduceOp

    return None, None, ReduceOp.SUM, ReduceOp.SUM  # the fault: no average over the ranks


class SummingFork(FullyShardAdapter):
    def __init__(self):
        from reference._fully_shard import _fsdp_collectives

        super().__init__("reference", name="summing-fork", version="test fault: SUM, not AVG")
        _fsdp_collectives._get_gradient_divide_factors = _summing_divide_factors


def _run(args, cwd, timeout=600):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_broken_fork_found_and_repro_fails_alone_but_passes_on_reference(tmp_path):
    reports = tmp_path / "reports"
    run = _run([sys.executable, "-m", "conformance", "--impl", FORK, "--world-sizes", "2",
                "--reports-dir", str(reports), "-q", "-p", "no:cacheprovider",
                "conformance/checks/fuzz.py::train_parity"], cwd=ROOT)
    assert run.returncode != 0, run.stdout[-3000:]
    assert "Standalone reproducer" in run.stdout
    (record,) = [c for c in json.loads((reports / "conformance.json").read_text())["cases"]
                 if c["id"] == "fuzz::train_parity[ws2]"]
    assert record["outcome"] == "fail"
    script = record["repro_script"]
    assert f"IMPL = {FORK!r}" in script and "WORLD_SIZE = 2" in script
    expected = re.findall(r"AssertionError: (\[rank \d/2\] .*)", record["message"])
    assert expected, record["message"][-2000:]

    broken = tmp_path / "repro.py"
    broken.write_text(script)
    alone = _run([sys.executable, str(broken)], cwd=tmp_path)
    assert alone.returncode != 0, alone.stdout + alone.stderr[-2000:]
    assert any(line in alone.stderr for line in expected), (expected, alone.stderr[-3000:])

    fixed = tmp_path / "repro_reference.py"
    fixed.write_text(script.replace(f"IMPL = {FORK!r}", "IMPL = 'reference'"))
    control = _run([sys.executable, str(fixed)], cwd=tmp_path)
    assert control.returncode == 0, control.stderr[-3000:]
    assert "passed" in control.stdout


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(1, 4), st.sampled_from(["reference", "reference-fsdp1"]), st.data())
def test_examples_are_plain_and_build_deterministically(ws, impl, data):
    """An example is a plain dict whose repr evaluates back to it, and every build of it (as each
    rank does) gives the same values; a wrap plan lists its units deepest first, the root last."""
    example = data.draw(fs.examples(ws, load_implementation(impl)))
    assert eval(repr(example)) == example  # noqa: S307 - the repro script embeds this repr
    a, b = fm.build(example), fm.build(example)
    assert all(p.equal(q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    plan = fm.plan(example)
    assert plan[-1][0] == ""
    depths = [p.count(".") for p, _ in plan[:-1]]
    assert depths == sorted(depths, reverse=True)
