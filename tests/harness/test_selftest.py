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

from conformance import spec
from conformance.registry import CHECKS
from conformance.selftest import FAULTS, _patching, score
from conformance.selftest.faults import BUILTIN_TARGETS

ROOT = Path(__file__).resolve().parents[2]
# The areas a fault must aim at: every area that has checks, less those whose checks run only
# other areas' rules (fuzz re-checks every part's rules on random models; strict re-runs the
# bad-input checks with strict=True; lifecycle's faults are aimed at states/fsdp2_state_dict).
UNTARGETED_AREAS = {"fuzz", "strict", "lifecycle"}


def registered_areas() -> set[str]:
    spec.load_checks()
    return {s.area for s in CHECKS}


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
    defined = spec.definitions(spec.SPEC_MD.read_text())
    areas = registered_areas()
    for f in FAULTS.values():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", f.id), f.id
        assert f.impl in BUILTIN_TARGETS, (f.id, f.impl)
        assert f.behaviour in defined, (f.id, f.behaviour)  # an id SPEC.md defines
        assert f.area in areas, (f.id, f.area)
        assert f.description and "\n" not in f.description, f.id
        assert f.world_sizes and all(1 <= w <= 4 for w in f.world_sizes), f.id


def test_faults_cover_every_implementation_and_area_and_odd_world_sizes():
    assert {f.impl for f in FAULTS.values()} == set(BUILTIN_TARGETS)
    assert {f.area for f in FAULTS.values()} == registered_areas() - UNTARGETED_AREAS
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
    assert impl.inherits == "reference"
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
    counts = {k: stats[k] for k in ("faults", "caught", "missed", "broken", "not_run", "score")}
    assert counts == {
        "faults": 2,
        "caught": 1,
        "missed": 1,
        "broken": 0,
        "not_run": 1,
        "score": 0.5,
    }
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


# ------------------------------------------------- a catch is a failure the fault caused (fuzz)
FUZZ_CASE = "fuzz::train_parity[ws2]"


def _fuzz_record(impl, outcome, drawn, settings="s1", **extra):
    """A fuzz case record as the fuzz item writes it (see conformance.fuzz.item.ran_record)."""
    fuzz = {"settings": settings, "drawn": list(drawn), "budget": 8, "failed": outcome == "fail"}
    record = {**_record(impl, FUZZ_CASE, outcome), "area": "fuzz", "world_size": 2, "fuzz": fuzz}
    return {**record, **extra}


def test_fuzz_failure_on_examples_the_control_never_ran_is_not_a_catch():
    """The fault fails a fuzz case on an example its control did not draw (say, the one upstream's
    own bug fails on, steered around for the control only): the fault is invisible to the fuzz
    area, and the old rule (same case id) would have credited it."""
    control = _fuzz_record("reference", "pass", ["e1", "e2", "e3", "e4"])
    other_examples = _fuzz_record(MINE, "fail", ["e1", "x2"])
    verdict = score.judge(FAULT, [control, other_examples], [2])
    assert verdict.status == score.MISSED and verdict.caught_by == []
    assert verdict.old_caught_by == [FUZZ_CASE] and verdict.only_fuzz_before
    assert "from #2 on" in verdict.withdrawn[FUZZ_CASE]

    other_settings = _fuzz_record(MINE, "fail", ["e1"], settings="s2")  # other features/drops
    verdict = score.judge(FAULT, [control, other_settings], [2])
    assert verdict.status == score.MISSED and "other settings" in verdict.withdrawn[FUZZ_CASE]


def test_fuzz_failure_on_the_controls_own_examples_is_a_catch():
    control = _fuzz_record("reference", "pass", ["e1", "e2", "e3", "e4"])
    for failed_at in range(1, 5):  # hypothesis stops drawing at the fault's first failure
        fault = _fuzz_record(MINE, "fail", ["e1", "e2", "e3", "e4"][:failed_at])
        verdict = score.judge(FAULT, [control, fault], [2])
        assert verdict.status == score.CAUGHT and verdict.caught_by == [FUZZ_CASE], failed_at
        assert verdict.withdrawn == {} and verdict.old_caught_by == [FUZZ_CASE]


def test_fuzz_catch_needs_both_fingerprints_and_a_passing_control():
    fault = _fuzz_record(MINE, "fail", ["e1"])
    unrecorded = {k: v for k, v in _fuzz_record("reference", "pass", ["e1"]).items() if k != "fuzz"}
    assert score.judge(FAULT, [unrecorded, fault], [2]).status == score.MISSED
    xfail = _fuzz_record("reference", "xfail", ["e1"])
    assert score.judge(FAULT, [xfail, fault], [2]).status == score.MISSED


def test_ordinary_case_needs_the_same_world_size_and_options():
    control = {**_record("reference", "x::a[ws2]", "pass"), "world_size": 2, "backend": "gloo"}
    fault = {**_record(MINE, "x::a[ws2]", "fail"), "world_size": 2, "backend": "gloo"}
    assert score.judge(FAULT, [control, fault], [2]).caught_by == ["x::a[ws2]"]
    verdict = score.judge(FAULT, [{**control, "backend": "nccl"}, fault], [2])
    assert verdict.status == score.MISSED and "backend" in verdict.withdrawn["x::a[ws2]"]


def test_reports_list_the_catches_only_the_old_rule_credited():
    control = _fuzz_record("reference", "pass", ["e1", "e2"])
    records = [
        control,
        _fuzz_record(MINE, "fail", ["x1"]),
        {**_record("reference", "t::a[ws2]", "pass"), "world_size": 2},
        {**_record(MINE, "t::a[ws2]", "fail"), "world_size": 2},
    ]
    verdict = score.judge(FAULT, records, [2])
    assert verdict.caught_by == ["t::a[ws2]"] and not verdict.only_fuzz_before
    stats = score.summary([verdict])
    assert stats["caught"] == 1 and stats["old_rule"]["withdrawn_catches"] == 1
    assert "1 catch(es) of 1 fault(s) withdrawn" in score.score_line(stats)
    table = "\n".join(score.table_lines([verdict]))
    assert f"{FAULT.id}: 1 of 2" in table and FUZZ_CASE in table
    md = score.markdown([verdict], stats, [])
    withdrawn_section = md.split("## Catches the old rule credited")[1].split("## Faults whose")[0]
    assert f"`{FAULT.id}`: 1 of 2 withdrawn" in withdrawn_section and FUZZ_CASE in md


def test_fuzz_item_records_what_it_ran_and_one_count_story():
    from conformance.fuzz import item

    stats = {"drawn": ["a", "b", "c"], "not_supported": 1, "shrink_runs": 40, "first_failure": 1.0}
    record = item.ran_record({"case": "x"}, stats, 8)
    assert record["drawn"] == ["a", "b", "c"] and record["budget"] == 8 and record["failed"]
    assert record["fingerprint"] != item.ran_record({"case": "y"}, stats, 8)["fingerprint"]
    line = item.counts_line(stats, 8, 90.0)
    assert line.startswith("example 3 of this case's budget of 8 failed")
    assert "1 more drawn, not supported" in line and "shrinking ran 40 more" in line
    assert "not shrunk" in item.counts_line(stats, 8, 0.0)


def test_real_run_credits_a_fuzz_failure_only_on_the_controls_examples(tmp_path):
    """One short ws-2 run: a reference fault the fuzz area sees (it draws the reference's
    examples) is caught by ``fuzz::train_parity``; an upstream fault the fuzz area cannot see is
    not, whether it drew examples its control never ran (and failed on upstream's own bug) or
    drew the control's and passed."""
    visible, invisible = "ref-rs-sum-not-avg", "t2-mp-casts-int-params"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "selftest",
            "-k",
            f"{visible},{invisible}",
            "--world-sizes",
            "2",
            "--checks",
            "fuzz and train_parity",
            "--reports-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = tmp_path / "selftest.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {f["fault_id"]: f for f in json.loads(report.read_text())["faults"]}
    assert verdicts[visible]["caught_by"] == [FUZZ_CASE], verdicts[visible]
    assert verdicts[invisible]["caught_by"] == [], verdicts[invisible]
    records = json.loads((tmp_path / "selftest-ws2" / "conformance.json").read_text())["cases"]
    fuzz = {r["impl"]: r["fuzz"] for r in records}
    assert fuzz["reference"]["drawn"][:1] == fuzz[f"fault-{visible}"]["drawn"][:1]
    if FUZZ_CASE in verdicts[invisible]["old_caught_by"]:  # failed on examples of its own
        assert "control" in verdicts[invisible]["withdrawn"][FUZZ_CASE]


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
