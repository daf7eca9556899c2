"""The public API surface map (conformance/apisurface, docs/api-coverage.md): every entry of the
pinned torch is covered by a check or out of scope with a reason; the introspection finds the
entries of the torch it imports; the trace records what a check calls and passes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.apisurface import report, surface, trace

PINNED = "2.13.0"
pinned = pytest.mark.skipif(
    torch.__version__.split("+")[0] != PINNED,
    reason=f"the snapshot and out-of-scope lines are of torch {PINNED}; "
    f"this is {torch.__version__}",
)


@pinned
def test_every_entry_is_covered_or_out_of_scope():
    """The uncovered entries are exactly those of uncovered.txt: a new entry nobody covers fails,
    and so does an allowlisted one that a check now covers (take it off the list)."""
    table = report.rows(surface.entries(), report.load_snapshot(), report.load_out_of_scope())
    uncovered = {r.id for r in table if r.status == "uncovered"}
    allowed = report.load_allowlist()
    assert len(allowed) == len(set(allowed)), "uncovered.txt lists an entry twice"
    new = sorted(uncovered - set(allowed))
    fixed = sorted(set(allowed) - uncovered)
    assert not new, (
        f"{len(new)} entries of torch {torch.__version__} have neither a covering check nor an "
        f"out-of-scope line (write a check, then `python -m conformance api-coverage --trace "
        f"--write`; or add a line with its reason to out_of_scope.toml): {new}"
    )
    assert not fixed, (
        f"uncovered.txt lists {fixed}, which are now covered or out of scope: remove them from "
        f"conformance/apisurface/uncovered.txt"
    )


@pinned
def test_inputs_match_the_surface():
    """Every out-of-scope line names an entry no check covers; the snapshot records only
    entries of this torch."""
    found = report.problems(surface.entries(), report.load_snapshot(), report.load_out_of_scope())
    assert not found, "\n".join(found)


def test_out_of_scope_lines_need_a_reason(tmp_path):
    path = tmp_path / "oos.toml"
    path.write_text('[[out_of_scope]]\nentries = ["fsdp.fully_shard"]\nreason = " "\n')
    with pytest.raises(ValueError, match="has no reason"):
        report.load_out_of_scope(path)
    path.write_text(
        '[[out_of_scope]]\nentries = ["a"]\nreason = "r"\n'
        '[[out_of_scope]]\nentries = ["a"]\nreason = "s"\n'
    )
    with pytest.raises(ValueError, match="'a' is listed twice"):
        report.load_out_of_scope(path)


def test_introspection_finds_known_entries():
    by_id = surface.entries().by_id()
    known = {
        "fsdp.fully_shard": "name",
        "fsdp.fully_shard(reshard_after_forward=)": "keyword",
        "fsdp.FullyShardedDataParallel(sharding_strategy=)": "keyword",
        "fsdp.FSDPModule.set_requires_gradient_sync": "method",
        "fsdp.FullyShardedDataParallel.summon_full_params": "method",  # a static method
        "fsdp.FullyShardedDataParallel.module": "method",  # a property
        "fsdp.ShardingStrategy.NO_SHARD": "member",
        "fsdp.StateDictType.SHARDED_STATE_DICT": "member",
        "fsdp.MixedPrecision.reduce_dtype": "field",
        "fsdp.MixedPrecisionPolicy.param_dtype": "field",
        "fsdp.FullStateDictConfig.rank0_only": "field",
        "fsdp.wrap.size_based_auto_wrap_policy(min_num_params=)": "keyword",
        "fsdp.wrap.ModuleWrapPolicy": "name",
        "dsd.set_optimizer_state_dict(options=)": "keyword",
        "dsd.StateDictOptions.full_state_dict": "field",
    }
    for entry, kind in known.items():
        assert entry in by_id, f"{entry} not found by the introspection"
        assert by_id[entry].kind == kind, f"{entry} is a {by_id[entry].kind}, expected {kind}"
    # private names stay out: an underscore member, field or method is no entry
    assert not [e for e in by_id if "._" in e or "(_" in e], [e for e in by_id if "._" in e]
    # the policies' positional (module, recurse, nonwrapped_numel) are FSDP's, not knobs
    assert "fsdp.wrap.size_based_auto_wrap_policy(recurse=)" not in by_id


def test_introspection_follows_the_imported_torch(monkeypatch):
    """A name, method, enum-free config and its field added to torch's modules appear as entries
    (nothing in the map is typed by hand)."""
    import torch.distributed.fsdp as fsdp

    @dataclasses.dataclass
    class NewConfig:
        knob: int = 3

    def new_api(module, *, extra=None):
        return module

    monkeypatch.setattr(fsdp, "NewConfig", NewConfig, raising=False)
    monkeypatch.setattr(fsdp, "new_api", new_api, raising=False)
    monkeypatch.setattr(fsdp, "__all__", [*fsdp.__all__, "NewConfig", "new_api"])
    monkeypatch.setattr(fsdp.FSDPModule, "set_new_knob", lambda self, flag: None, raising=False)
    ids = set(surface.entries().ids())
    for entry in (
        "fsdp.NewConfig",
        "fsdp.NewConfig.knob",
        "fsdp.new_api",
        "fsdp.FSDPModule.set_new_knob",
    ):
        assert entry in ids, f"{entry} was added to torch but the introspection missed it"


def test_rows_and_problems_on_a_synthetic_surface():
    s = surface.Surface(
        "x",
        [
            surface.Entry("fsdp.E", "name"),
            surface.Entry("fsdp.E.A", "member", "fsdp.E"),
            surface.Entry("fsdp.E.B", "member", "fsdp.E"),
            surface.Entry("fsdp.f", "name"),
        ],
    )
    snapshot = {"entries": {"fsdp.E.A": {"checks": ["a::c"]}, "fsdp.gone": {"checks": ["a::d"]}}}
    table = {r.id: r for r in report.rows(s, snapshot, {"fsdp.f": "needs CUDA"})}
    assert (table["fsdp.E.A"].status, table["fsdp.E.A"].checks) == ("covered", ["a::c"])
    assert (table["fsdp.E"].status, table["fsdp.E"].via) == ("covered", "fsdp.E.A")
    assert table["fsdp.E.B"].status == "uncovered"
    assert (table["fsdp.f"].status, table["fsdp.f"].reason) == ("out-of-scope", "needs CUDA")
    found = report.problems(s, snapshot, {"fsdp.E.A": "r", "fsdp.nope": "r"})
    assert any("'fsdp.nope', which is no entry" in p for p in found), found
    assert any("'fsdp.E.A', but checks cover it" in p for p in found), found
    assert any("coverage.json records 'fsdp.gone'" in p for p in found), found
    assert report.summary(list(table.values()))["uncovered"] == 1


def test_a_partial_trace_replaces_what_its_checks_recorded():
    old = {
        "key": "k",
        "entries": {
            "fsdp.a": {"checks": ["x::one", "x::two"], "impls": ["torch-fsdp2"], "values": []},
            "fsdp.b": {"checks": ["x::two"], "impls": ["torch-fsdp2"], "values": []},
        },
    }
    case = {"id": "x::two[ws2]", "check": "two", "impl": "torch-fsdp1", "outcome": "pass"}
    partial = {"cases": {"n1": case | {"entries": {"fsdp.c": ["1"]}}}}
    merged = report.merge_snapshot(old, partial, "two")
    assert merged["entries"]["fsdp.a"]["checks"] == ["x::one"]  # x::two no longer calls it
    assert "fsdp.b" not in merged["entries"]
    assert merged["entries"]["fsdp.c"] == {
        "checks": ["x::two"],
        "impls": ["torch-fsdp1"],
        "values": ["1"],
    }
    assert (merged["key"], merged["merged"]) == ("k", ["two"])


def test_wide_selection_picks_checks_that_need_more_ranks():
    """At world size 4 the trace reruns the checks no case at 1-2 ranks covered (written for 4
    ranks) and those that need a 2-D mesh; a covered check that needs neither is left out."""
    base = {
        "cases": {
            "n": {"id": "states::set_reshard_after_forward_at_run_time[ws2-child-false]",
                  "outcome": "pass"},
            "h": {"id": "states::hsdp_states[ws4-true]", "outcome": "pass"},
        }
    }  # fmt: skip
    targets = trace.wide_selection(base, 4)
    assert "conformance/checks/fully_shard/states.py::hsdp_states" in targets, targets
    assert not [t for t in targets if t.endswith("::set_reshard_after_forward_at_run_time")]
    assert all("::" in t and t.split("::")[0].endswith(".py") for t in targets), targets


def test_cli_prints_the_map_and_refuses_write_without_trace(capsys):
    assert report.main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["entries"] == len(doc["entries"]) > 100, doc["summary"]
    assert {r["status"] for r in doc["entries"]} <= {"covered", "out-of-scope", "uncovered"}
    assert report.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# API coverage") and "| `fsdp.fully_shard` | name |" in out, out[:500]
    with pytest.raises(SystemExit):
        report.main(["--write"])
    assert "add --trace" in capsys.readouterr().err


def test_cli_only_write_merges_into_the_snapshot(tmp_path, monkeypatch, capsys):
    """``--trace --only EXPR --write`` runs the partial trace with ``-k EXPR`` and writes the
    merged snapshot."""
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"key": "k", "entries": {}}))
    monkeypatch.setattr(report, "SNAPSHOT", path)
    seen = []
    case = {"id": "x::new[ws1]", "check": "new", "impl": "torch-fsdp2", "outcome": "pass"}

    def fake_run_trace(ws, extra=None, **kwargs):
        seen.append(extra)
        return {"cases": {"n": case | {"entries": {"fsdp.fully_shard": []}}}, "wall_s": 1.0}

    monkeypatch.setattr(trace, "run_trace", fake_run_trace)
    assert report.main(["--trace", "--only", "new", "--write", "--json"]) == 0
    capsys.readouterr()
    assert seen == [["-k", "new"]]
    written = json.loads(path.read_text())
    assert written["entries"]["fsdp.fully_shard"]["checks"] == ["x::new"], written
    assert written["merged"] == ["new"]


def test_recorder_scans_passed_members_policies_and_configs():
    """What an argument passes: public enum members (a private one is no entry), a policy
    function, a ``functools.partial`` of one with its non-default keywords, a config instance's
    non-default fields; one level into a list."""
    import functools

    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp import wrap

    recorder = trace._Recorder(trace._Watch())
    recorder.scan(fsdp.ShardingStrategy.NO_SHARD)
    recorder.scan(fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2)
    recorder.scan([wrap.always_wrap_policy])
    recorder.scan(functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=5))
    recorder.scan(fsdp.FullStateDictConfig(rank0_only=True))
    assert recorder.seen == {
        "fsdp.ShardingStrategy.NO_SHARD": set(),
        "fsdp.wrap.always_wrap_policy": set(),
        "fsdp.wrap.size_based_auto_wrap_policy": set(),
        "fsdp.wrap.size_based_auto_wrap_policy(min_num_params=)": {"5"},
        "fsdp.FullStateDictConfig": set(),
        "fsdp.FullStateDictConfig.rank0_only": {"True"},
    }, recorder.seen


@pytest.fixture(scope="module")
def tiny_trace():
    return trace.run_trace(
        ws=[1],
        extra=["--check-dir", "tests/harness/apichecks", "-k", "apitrace"],
        timeout=600,
        quiet=True,
    )


def _case(data: dict, check: str, impl: str) -> dict:
    (case,) = [c for c in data["cases"].values() if c["check"] == check and c["impl"] == impl]
    return case


def test_trace_records_calls_keywords_members_and_fields(tiny_trace):
    assert tiny_trace["recorder_errors"] == [], tiny_trace["recorder_errors"]
    fsdp2 = _case(tiny_trace, "fsdp2_calls", "torch-fsdp2")
    assert fsdp2["outcome"] == "pass", fsdp2
    got = fsdp2["entries"]
    for entry in (
        "fsdp.fully_shard",
        "fsdp.fully_shard(mesh=)",
        "fsdp.fully_shard(mp_policy=)",
        "fsdp.MixedPrecisionPolicy",
        "fsdp.FSDPModule.set_requires_gradient_sync",
    ):
        assert entry in got, f"{entry} not recorded; recorded: {sorted(got)}"
    assert got["fsdp.fully_shard(reshard_after_forward=)"] == ["False"], got
    assert got["fsdp.MixedPrecisionPolicy.param_dtype"] == ["torch.float64"], got
    # left at their defaults: not recorded
    for entry in (
        "fsdp.fully_shard(shard_placement_fn=)",
        "fsdp.MixedPrecisionPolicy.reduce_dtype",
    ):
        assert entry not in got, f"{entry} recorded, but the check left it at its default"

    fsdp1 = _case(tiny_trace, "fsdp1_calls", "torch-fsdp1")
    assert fsdp1["outcome"] == "pass", fsdp1
    got = fsdp1["entries"]
    for entry in (
        "fsdp.FullyShardedDataParallel",
        "fsdp.FullyShardedDataParallel(sharding_strategy=)",
        "fsdp.FullyShardedDataParallel(auto_wrap_policy=)",
        "fsdp.ShardingStrategy.SHARD_GRAD_OP",
        "fsdp.wrap.size_based_auto_wrap_policy",
        "fsdp.FullyShardedDataParallel.state_dict_type",
        "fsdp.StateDictType.FULL_STATE_DICT",
        "fsdp.FullStateDictConfig",
    ):
        assert entry in got, f"{entry} not recorded; recorded: {sorted(got)}"
    assert got["fsdp.wrap.size_based_auto_wrap_policy(min_num_params=)"] == ["1"], got
    # torch's own calls are not the check's: state_dict_type calls set_state_dict_type inside
    assert "fsdp.FullyShardedDataParallel.set_state_dict_type" not in got, sorted(got)
    assert "fsdp.FullStateDictConfig.rank0_only" not in got, "rank0_only=False is its default"

    nothing = _case(tiny_trace, "calls_nothing", "torch-fsdp2")
    assert nothing["outcome"] == "pass" and nothing["entries"] == {}, nothing


def test_snapshot_counts_only_cases_that_asserted(tiny_trace):
    """A not-supported case (fsdp2_calls on torch-fsdp1) covers nothing; passing cases cover
    what they recorded, under their check id."""
    assert _case(tiny_trace, "fsdp2_calls", "torch-fsdp1")["outcome"] == "not-supported"
    entries = report.snapshot_from_trace(tiny_trace)["entries"]
    assert entries["fsdp.fully_shard"]["checks"] == ["apitrace::fsdp2_calls"], entries
    assert entries["fsdp.fully_shard"]["impls"] == ["torch-fsdp2"], entries
    assert entries["fsdp.ShardingStrategy.SHARD_GRAD_OP"]["checks"] == ["apitrace::fsdp1_calls"]
