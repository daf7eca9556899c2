"""The self-test's fault library, its verdict/score logic, and the fast subset end to end.

The fast subset (one fault per area, ``--fast``) runs against the checks that cover those areas
(``FAST_CHECKS``) at the world sizes the faults need, next to the unpatched control: every fault
must be caught and the control clean. ``nox -s selftest`` runs every fault on the whole suite.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.selftest import FAULTS, _patching, score
from conformance.selftest.faults import BUILTIN_TARGETS

ROOT = Path(__file__).resolve().parents[2]
AREAS = {
    "layout",
    "states",
    "placement",
    "extensions",
    "training",
    "mixed_precision",
    "fsdp2_state_dict",
    "state_dict",
    "wrap",
    "bad_input",
    "tensor_parallel",
    "param_subclass",
}
# Checks that cover the fast subset's areas (one pytest -k expression).
# (Single words would also match fault names such as fault-r1-keys-keep-prefix.)
FAST_CHECKS = (
    "per_param_dim0_padded_storage or flat_param_shard or registered_after_forward "
    "or invalid_placement_errors or all_gather_through_hooks or "
    "train_parity_cpu_offload or non_float_parameter or load_dtensors or "
    "incompatible_keys or fsdp1_auto_wrap_units"
)


# ------------------------------------------------------------------------------ the library
def test_library_has_at_least_40_well_formed_faults():
    assert len(FAULTS) >= 40, len(FAULTS)
    for f in FAULTS.values():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", f.id), f.id
        assert f.impl in BUILTIN_TARGETS, (f.id, f.impl)
        assert re.fullmatch(r"[PSW]\d+", f.behaviour), (f.id, f.behaviour)
        assert f.area in AREAS, (f.id, f.area)
        assert f.description and "\n" not in f.description, f.id
        assert f.world_sizes and all(1 <= w <= 4 for w in f.world_sizes), f.id


def test_faults_cover_every_implementation_and_area_and_odd_world_sizes():
    assert {f.impl for f in FAULTS.values()} == set(BUILTIN_TARGETS)
    assert {f.area for f in FAULTS.values()} == AREAS
    assert any(3 in f.world_sizes for f in FAULTS.values())
    fast_areas = [f.area for f in FAULTS.values() if f.fast]
    assert len(fast_areas) >= 8 and len(set(fast_areas)) >= len(fast_areas) - 2, fast_areas


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_every_target_resolves(fault_id):
    """A fault whose target moved is broken: found here, not by a run that reports it missed."""
    _patching.resolve(FAULTS[fault_id].target)


def test_patch_applies_and_restores_in_process():
    from reference import wrap as ref_wrap

    policy = ref_wrap.size_based_auto_wrap_policy
    module = __import__("torch").nn.Linear(5, 5)  # 30 parameter elements
    assert policy(module, recurse=False, nonwrapped_numel=30, min_num_params=30)
    fault = FAULTS["w-size-threshold-strict"]
    with _patching.patch(fault.target, fault.make):
        assert not ref_wrap.size_based_auto_wrap_policy(module, False, 30, min_num_params=30)
        assert ref_wrap.size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # attributes kept
    assert ref_wrap.size_based_auto_wrap_policy is policy


def test_missing_target_is_a_broken_fault():
    with pytest.raises(_patching.BrokenFault, match="no module"):
        _patching.resolve("reference:no_such_function_anywhere")
    with pytest.raises(_patching.BrokenFault, match="no attribute"):
        _patching.resolve("reference._fully_shard:FSDPParam.no_such_method")


def test_fault_specs_load_as_implementations():
    from conformance.adapters.registry import load_implementation

    fault = FAULTS["ref-rs-sum-not-avg"]
    impl = load_implementation(fault.spec)
    assert impl.name == "fault-ref-rs-sum-not-avg"
    assert impl.expectations_name == "reference"
    assert impl.capabilities == load_implementation("reference").capabilities
    assert impl.ns.__name__ == "reference"  # what the API-level checks use


# ---------------------------------------------------------------------------- verdict logic
def _record(impl, case, outcome, message=""):
    return {"impl": impl, "id": case, "outcome": outcome, "message": message}


FAULT = FAULTS["ref-rs-sum-not-avg"]
MINE = FAULT.adapter_name


def test_caught_when_a_case_passing_on_the_control_fails_on_the_fault():
    records = [
        _record("reference", "training::a[ws2]", "pass"),
        _record(MINE, "training::a[ws2]", "fail"),
        _record("reference", "training::b[ws2]", "pass"),
        _record(MINE, "training::b[ws2]", "pass"),
    ]
    verdict = score.judge(FAULT, records, [2])
    assert verdict.status == score.CAUGHT
    assert verdict.caught_by == ["training::a[ws2]"]


def test_expected_failures_count_only_when_they_fail_differently():
    records = [
        _record("reference", "x::a[ws2]", "xfail"),
        _record(MINE, "x::a[ws2]", "xfail"),
        _record("reference", "x::b[ws2]", "fail"),
        _record(MINE, "x::b[ws2]", "fail"),
    ]
    assert score.judge(FAULT, records, [2]).status == score.MISSED
    records.append(_record(MINE, "x::c[ws2]", "fail"))
    records.append(_record("reference", "x::c[ws2]", "xfail"))
    assert score.judge(FAULT, records, [2]).caught_by == ["x::c[ws2]"]


def test_broken_fault_is_never_caught():
    records = [
        _record("reference", "x::a[ws2]", "pass"),
        _record(
            MINE,
            "x::a[ws2]",
            "fail",
            "rank 0: error\n  conformance.selftest._patching.BrokenFault: gone",
        ),
    ]
    verdict = score.judge(FAULT, records, [2])
    assert verdict.status == score.BROKEN and "gone" in verdict.detail


def test_not_run_summary_and_exit_code():
    not_run = score.judge(FAULT, [], [])
    assert not_run.status == score.NOT_RUN and "world size 2" in not_run.detail
    caught = score.Verdict("a", "reference", "P6", "training", "d", [2], score.CAUGHT, ["x"])
    missed = score.Verdict("b", "reference", "P6", "training", "d", [2], score.MISSED)
    stats = score.summary([caught, missed, not_run])
    assert stats == {"faults": 2, "caught": 1, "missed": 1, "broken": 0, "not_run": 1, "score": 0.5}
    assert score.exit_code([caught, not_run], []) == 0
    assert score.exit_code([caught, missed], []) == 1
    assert score.exit_code([caught], ["reference x::a[ws2]"]) == 1
    assert "1/2 = 50%" in score.score_line(stats)
    assert score.control_failures(
        [_record("reference", "x::a[ws2]", "fail"), _record(MINE, "x::b[ws2]", "fail")],
        {"reference"},
    ) == ["reference x::a[ws2]"]


def test_table_and_markdown_name_every_fault_and_result():
    caught = score.Verdict(
        "a",
        "reference",
        "P6",
        "training",
        "desc a",
        [2],
        score.CAUGHT,
        [f"t::c{i}[ws2]" for i in range(5)],
    )
    missed = score.Verdict("b", "torch-fsdp1", "S3", "state_dict", "desc b", [3], score.MISSED)
    lines = score.table_lines([caught, missed])
    assert (
        lines[1].startswith("a ")
        and "caught by 5: t::c0[ws2]" in lines[1]
        and "+2 more" in lines[1]
    )
    assert lines[2].split()[-1] == "MISSED"
    md = score.markdown([caught, missed], score.summary([caught, missed]), [])
    assert "| `b` | torch-fsdp1 | S3 |" in md and "**MISSED**" in md and "clean" in md


# ------------------------------------------------------------------- the fast subset, end to end
def test_fast_subset_every_fault_caught_and_control_clean(tmp_path):
    """One conformance run (world size 2) with the fast faults and their controls."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "selftest",
            "--fast",
            "--checks",
            FAST_CHECKS,
            "--reports-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = tmp_path / "selftest.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    missed = [
        (f["fault_id"], f["status"], f["detail"])
        for f in data["faults"]
        if f["status"] != score.CAUGHT
    ]
    assert not missed, proc.stdout[-4000:]
    assert data["control_failures"] == [], data["control_failures"]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert data["summary"]["score"] == 1.0
