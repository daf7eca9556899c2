"""The fuzz area finds a deliberately broken fork and prints a reproducer that fails on its own,
while the same reproducer passes against the unbroken implementation.

``SummingFork`` is the reference FSDP2 with one rule broken in every process that loads it: the
gradient reduce-scatter sums over the ranks instead of averaging (P6), which only shows when
training at world size >= 2.
"""

from __future__ import annotations

import json
import os
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


def _summing_divide_factors(
    reduce_scatter_group, all_reduce_group, reduce_dtype, factor, force_sum=False
):
    from torch.distributed import ReduceOp

    return None, None, ReduceOp.SUM, ReduceOp.SUM  # the fault: no average over the ranks


class SummingFork(FullyShardAdapter):
    def __init__(self):
        from reference._fully_shard import _fsdp_collectives

        super().__init__("reference", name="summing-fork", version="test fault: SUM, not AVG")
        _fsdp_collectives._get_gradient_divide_factors = _summing_divide_factors


def _run(args, cwd, timeout=600, env=None):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _conformance(impl: str, world_size: int, reports, check: str):
    """``python -m conformance`` for one check on one implementation and world size, quiet,
    writing into ``reports``."""
    args = ["--impl", impl, "--world-sizes", str(world_size), "--reports-dir", str(reports), "-q"]
    return _run(
        [sys.executable, "-m", "conformance", *args, "-p", "no:cacheprovider", check], cwd=ROOT
    )


def test_broken_fork_found_and_repro_fails_alone_but_passes_on_reference(tmp_path):
    reports = tmp_path / "reports"
    run = _conformance(FORK, 2, reports, "conformance/checks/fuzz/fuzz.py::train_parity")
    assert run.returncode != 0, run.stdout[-3000:]
    assert "Standalone reproducer" in run.stdout
    (record,) = [
        c
        for c in json.loads((reports / "conformance.json").read_text())["cases"]
        if c["id"] == "fuzz::train_parity[ws2]"
    ]
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


def _case_features(check_fn, case: str, impl_name: str) -> frozenset:
    from conformance.fuzz import dropped

    drops = dropped(check_fn.fuzz_drops, case, impl_name)
    return check_fn.fuzz_features.difference(*(d.features for d in drops))


def test_drops_are_per_implementation_and_case():
    """A drop for an upstream limitation leaves the feature in every other implementation's
    examples: the references are fuzzed on zero-numel parameters in SHARDED dicts and on ties in
    FULL dicts; only torch-fsdp1's SHARDED case loses zero sizes, and rank0_only (a FULL-dict
    option) is left out of every SHARDED case."""
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    for impl in ("reference", "reference-fsdp1", "torch-fsdp2", "torch-fsdp1", "some-fork"):
        assert fs.TIES in _case_features(state_dict_round_trip, "full", impl)
        assert fs.RANK0_ONLY in _case_features(state_dict_round_trip, "full", impl)
        assert fs.RANK0_ONLY not in _case_features(state_dict_round_trip, "sharded", impl)
        sharded = _case_features(state_dict_round_trip, "sharded", impl)
        assert (fs.ZERO_SIZE in sharded) == (impl != "torch-fsdp1"), (impl, sorted(sharded))


def test_reference_examples_use_the_feature_upstream_drops():
    """The features a case keeps reach the examples: the reference-fsdp1 SHARDED case draws
    zero-numel parameters, torch-fsdp1's never does (400 derandomized examples each)."""
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    for impl, expected in (("reference-fsdp1", True), ("torch-fsdp1", False)):
        features = _case_features(state_dict_round_trip, "sharded", impl)
        drawn = _derandomized(impl, features, 400)
        empty = [e for e in drawn if any(p.numel() == 0 for p in fm.build(e).parameters())]
        assert bool(empty) == expected, (impl, len(empty), sorted(features))


def test_drop_needs_a_reason_and_a_known_case():
    import pytest

    from conformance.fuzz import Drop, fuzz_check
    from conformance.registry import CHECKS, check

    with pytest.raises(ValueError, match="reason"):
        Drop(fs.TIES, " ")
    before = list(CHECKS)
    try:
        with pytest.raises(ValueError, match=r"unknown case\(s\) \['fulll'\]"):

            @fuzz_check(fs.ALL_FEATURES, drops=[Drop(fs.TIES, "a reason", cases="fulll")])
            @check(area="fuzz", cases={"full": {}})
            def misspelt(ctx, example):
                """A fuzz check whose drop names a case it does not have."""

        with pytest.raises(ValueError, match=r"unknown case\(s\) \['locl'\]"):

            @fuzz_check(fs.ALL_FEATURES, case_requires={"locl": {"local-state-dict"}})
            @check(area="fuzz", cases={"local": {}})
            def misspelt_requires(ctx, example):
                """A fuzz check whose case_requires names a case it does not have."""
    finally:
        CHECKS[:] = before


def test_local_case_is_not_supported_without_drawing_examples(tmp_path):
    """An FSDP2-style implementation has no LOCAL dicts: its local case is NotSupported at once
    (case_requires), not after hypothesis has rejected example after example."""
    reports = tmp_path / "reports"
    run = _conformance(
        "reference", 1, reports, "conformance/checks/fuzz/state_dict.py::state_dict_round_trip"
    )
    assert run.returncode == 0, run.stdout[-3000:]
    cases = {c["id"]: c for c in json.loads((reports / "conformance.json").read_text())["cases"]}
    local = cases["fuzz::state_dict_round_trip[ws1-local]"]
    assert local["outcome"] != "pass" and "does not declare local-state-dict" in local["message"]


def test_only_torch_fsdp1_steers_around_units_of_empty_parameters():
    """torch 2.13's FSDP1 cannot wrap a unit whose parameters are all empty, so torch-fsdp1's
    examples never hold one; reference-fsdp1 shards such units, so its examples do (400
    derandomized examples each, every feature)."""
    for impl, expected in (("reference-fsdp1", True), ("torch-fsdp1", False)):
        found = []
        for example in _derandomized(impl, fs.ALL_FEATURES, 400):
            model = fm.build(example)
            shapes = {n: p.shape for n, p in model.named_parameters()}
            owned = fm.managed(model, example["wrap"] + [""])
            if any(fqns and not any(fm.numel(shapes[f]) for f in fqns) for fqns in owned.values()):
                found.append(example)
        assert bool(found) == expected, (impl, len(found))


def _derandomized(impl, features, n, ws=2):
    """The first ``n`` derandomized examples for ``impl`` (as a fuzz case draws them)."""
    from hypothesis import HealthCheck

    drawn = []

    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(fs.examples(ws, load_implementation(impl), features))
    def draw(example):
        drawn.append(example)

    draw()
    return drawn


def test_zero_size_parameters_in_a_good_share_of_examples():
    """Where a check may draw zero-size parameters, at least 30% of the examples hold one (a 0 from
    ``dims`` alone reached 2-8%), but not nearly all; a check without the feature never gets one."""
    for impl in ("reference", "reference-fsdp1"):
        drawn = _derandomized(impl, fs.ALL_FEATURES, 100)
        empty = [e for e in drawn if any(p.numel() == 0 for p in fm.build(e).parameters())]
        assert 0.3 <= len(empty) / len(drawn) <= 0.8, (impl, len(empty), len(drawn))
        without = _derandomized(impl, fs.ALL_FEATURES - {fs.ZERO_SIZE}, 50)
        assert not any(any(p.numel() == 0 for p in fm.build(e).parameters()) for e in without)


def test_local_case_expects_each_units_flat_chunk():
    """state_dict_round_trip[local]: per unit with parameters, ``<unit>._flat_param`` holds the
    unpadded numel and this rank's chunk of the unit's parameters flattened in registration order
    (a unit without parameters has none); use_orig_params and rank0_only are left out of it."""
    from types import SimpleNamespace

    import torch

    from conformance.checks.fuzz.state_dict import local_expected, state_dict_round_trip

    example = {
        "seed": 0,
        "width": 3,
        "tree": {
            "kind": "seq",
            "children": [
                {"kind": "linear", "out": 2, "bias": True},  # 0: weight (2, 3), bias (2,)
                {"kind": "layernorm"},  # 1: weight (2,), bias (2,) -> its own unit
                {"kind": "seq", "children": [{"kind": "batchnorm"}]},  # 2.0 (the root's)
            ],
        },
        "steps": 2,
        "wrap": ["1"],
    }
    oracle = fm.build(example)
    values = {n: p.detach().clone() for n, p in oracle.named_parameters()}
    root = torch.cat(
        [values[n].reshape(-1) for n in ("0.weight", "0.bias", "2.0.weight", "2.0.bias")]
    )
    unit = torch.cat([values["1.weight"], values["1.bias"]])
    assert root.numel() == 12 and unit.numel() == 4
    # (ws, rank) -> the flat elements the rank holds: chunks of ceil(12/ws) and ceil(4/ws)
    for ws, rank, root_part, unit_part in ((3, 0, root[:4], unit[:2]), (2, 1, root[6:], unit[2:])):
        got = local_expected(SimpleNamespace(world_size=ws, rank=rank), example, oracle, values)
        assert set(got) == {"_flat_param", "1._flat_param"}
        assert got["_flat_param"][0] == 12 and torch.equal(got["_flat_param"][1], root_part)
        assert got["1._flat_param"][0] == 4 and torch.equal(got["1._flat_param"][1], unit_part)
    for impl in ("reference-fsdp1", "torch-fsdp1", "some-fork"):
        local = _case_features(state_dict_round_trip, "local", impl)
        assert fs.ORIG_PARAMS not in local and fs.RANK0_ONLY not in local, (impl, sorted(local))
        assert fs.ZERO_SIZE in local and fs.TIES in local and fs.MIXED_PRECISION in local


def test_assign_loads_drawn_for_fsdp2_sharded_dicts_only():
    """The sharded case of FSDP2-style implementations loads with ``assign=True`` in a good share
    of its examples, never for an example with ties (assign unties them) nor in the full and local
    cases or for FSDP1-style implementations."""
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    for impl in ("reference", "torch-fsdp2"):
        features = _case_features(state_dict_round_trip, "sharded", impl)
        # 120 draws: a fifth at least (60 gave 13-17, at the mercy of any change to the strategy)
        drawn = _derandomized(impl, features, 120)
        assigned = [e for e in drawn if e.get("assign")]
        assert len(assigned) >= 24, (impl, len(assigned))
        assert not any(e.get("ties") for e in assigned)
        for case in ("full", "local"):
            assert fs.ASSIGN not in _case_features(state_dict_round_trip, case, impl)
    drawn = _derandomized("reference-fsdp1", fs.ALL_FEATURES, 30)
    assert not any("assign" in e for e in drawn)


def test_hsdp_meshes_and_divide_factors_reach_train_parity():
    """train_parity's examples put FSDP2-style implementations on (replicate, shard) meshes at ws 2
    and 4 (never at 1 or 3, never FSDP1), and the reference's set per-unit gradient divide factors
    from (1, ws, 3); torch-fsdp2's do not (its Drop), nor do the other fuzz checks."""
    from conformance.checks.fuzz.fuzz import layout, train_parity
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    for ws in (1, 2, 3, 4):
        for impl in ("reference", "torch-fsdp2", "reference-fsdp1"):
            drawn = _derandomized(impl, _case_features(train_parity, "", impl), 40, ws)
            meshes = [e["mesh"] for e in drawn if "mesh" in e]
            if impl == "reference-fsdp1" or ws not in fs.HSDP_MESHES:
                assert not meshes, (impl, ws, meshes)
            else:
                assert len(meshes) >= 5 and all(m in fs.HSDP_MESHES[ws] for m in meshes)
                assert all(r * s == ws for r, s in meshes)
            factors = [f for e in drawn for f in e.get("divide_factors", {}).values()]
            if impl == "reference":
                assert len(factors) >= 10 and set(factors) <= {1.0, float(ws), 3.0}, factors
            else:
                assert not factors, (impl, ws)
    for check_fn, case in ((layout, ""), (state_dict_round_trip, "sharded")):
        features = _case_features(check_fn, case, "reference")
        assert fs.HSDP not in features and fs.DIVIDE_FACTOR not in features


def test_fsdp1_runtime_knobs_reach_the_examples():
    """FSDP1 implementations' train_parity examples give every unit of the plan a drawn
    sharding_strategy (each of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD drawn), prefetch knobs only
    where ``fsdp1-prefetch`` is declared, one limit_all_gathers per model and 0-2 no_sync
    micro-batches; hybrid strategies (torch-fsdp1: ``fsdp1-hybrid-shard``) on every unit of an
    example with an ``fsdp1_mesh``, never a one-rank shard row in training (its steer);
    FSDP2-style ones get none; layout draws strategies but no prefetch or accumulation; an
    example with rank0_only has no NO_SHARD unit and no state-dict case draws a hybrid mesh."""
    from conformance.checks.fuzz.fuzz import layout, train_parity
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    for impl in ("torch-fsdp1", "reference-fsdp1", "reference"):
        drawn = _derandomized(impl, _case_features(train_parity, "", impl), 40)
        if impl == "reference":
            assert not any("unit_knobs" in e or "accumulate" in e for e in drawn)
            continue
        assert all(set(e["unit_knobs"]) == set(e["wrap"]) | {""} for e in drawn)
        knobs = [k for e in drawn for k in e["unit_knobs"].values()]
        want = set(fs.STRATEGIES) | (set(fs.HYBRID_STRATEGIES) if impl == "torch-fsdp1" else set())
        assert {k["sharding_strategy"] for k in knobs} == want, impl
        for e in drawn:  # hybrid: every unit, on one (replicate, shard) mesh of a shard row > 1
            hybrid = {
                k["sharding_strategy"] in fs.HYBRID_STRATEGIES for k in e["unit_knobs"].values()
            }
            assert hybrid == {"fsdp1_mesh" in e}, e
            assert "fsdp1_mesh" not in e or e["fsdp1_mesh"] in ([1, 2],), e
        prefetch = [k["backward_prefetch"] for k in knobs if "backward_prefetch" in k]
        if impl == "torch-fsdp1":
            assert set(prefetch) == set(fs.BACKWARD_PREFETCHES), prefetch
            assert {k["forward_prefetch"] for k in knobs} == {False, True}
        else:  # reference-fsdp1 does not declare fsdp1-prefetch
            assert not prefetch and not any("forward_prefetch" in k for k in knobs)
        for e in drawn:
            assert len({k["limit_all_gathers"] for k in e["unit_knobs"].values()}) == 1
        assert {e["accumulate"] for e in drawn} == set(fs.ACCUMULATIONS)
    drawn = _derandomized("torch-fsdp1", _case_features(layout, "", "torch-fsdp1"), 30)
    assert all("accumulate" not in e for e in drawn)
    assert all(set(k) == {"sharding_strategy"} for e in drawn for k in e["unit_knobs"].values())
    features = _case_features(state_dict_round_trip, "full", "torch-fsdp1")
    sd_drawn = _derandomized("torch-fsdp1", features, 60)
    assert not any("fsdp1_mesh" in e for e in sd_drawn)
    rank0 = [e for e in sd_drawn if e.get("rank0_only")]
    assert rank0 and all(
        k["sharding_strategy"] != "NO_SHARD" for e in rank0 for k in e["unit_knobs"].values()
    )


def test_divide_factor_scales_the_oracle_gradient_per_unit():
    """With a unit's divide factor f the sharded gradient is the ranks' SUM over f, i.e. ws / f times
    the oracle's mean-loss gradient, for the parameters that unit manages; others keep 1."""
    from conformance.checks.fuzz._common import grad_scales

    example = {
        "seed": 0,
        "width": 2,
        "tree": {
            "kind": "seq",
            "children": [
                {"kind": "linear", "out": 2, "bias": True},
                {"kind": "seq", "children": [{"kind": "layernorm"}]},
                {"kind": "embedding", "num": 3},
            ],
        },
        "wrap": ["0", "1"],
        "divide_factors": {"0": 1.0, "": 3.0},
    }
    scales = grad_scales(example, fm.build(example), 4)
    assert scales == {"0.weight": 4.0, "0.bias": 4.0, "2.weight": 4 / 3}


def _rank_failure(detail: str):
    from types import SimpleNamespace

    from conformance.runner import protocol

    trace = f"Traceback (most recent call last):\n  File 'x.py', line 1, in f\n{detail}\n"
    return [
        SimpleNamespace(rank=0, status=protocol.ERROR, detail=trace, duration=0.1),
        SimpleNamespace(rank=1, status=protocol.OK, detail="", duration=0.1),
    ]


def test_a_fuzz_failure_is_judged_by_its_expectation_entry():
    """A listed fuzz case is expected (xfail) when its entry's signature fits the failing
    example's ranks, a plain failure naming the entry and the mismatch when it does not, and a
    plain failure when nothing lists it (as a hand-written case: issue 26, point 2)."""
    from conformance import expectations
    from conformance.fuzz.item import judged
    from conformance.plugin import CheckFailure, ExpectedFailure

    (fits, other) = expectations.parse(
        "fuzz::train_parity[ws2] raises=AssertionError match=/loss/ sums\n"
        "fuzz::train_parity[ws2] raises=RuntimeError sums\n",
        "mine.txt",
    )
    results = _rank_failure("AssertionError: [rank 0/2] step 0 loss 1.0 != 2.0")
    assert type(judged(fits, results, "the text")) is ExpectedFailure
    failure = judged(other, results, "the text")
    assert type(failure) is CheckFailure and "listed in mine.txt:2" in str(failure), str(failure)
    assert "raises=RuntimeError" in str(failure) and "the text" in str(failure)
    assert type(judged(None, results, "the text")) is CheckFailure


def test_a_listed_fuzz_case_is_an_expected_failure(tmp_path):
    """End to end: the summing fork's train_parity failure at ws 2, listed in its expectations
    file with a fitting signature, is reported xfail and the run passes."""
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "summing-fork.txt").write_text(
        "fuzz::train_parity[ws2] raises=AssertionError match=/\\[rank \\d\\/2\\]/  sums over ranks\n"
    )
    reports = tmp_path / "reports"
    args = ["--impl", FORK, "--world-sizes", "2", "--reports-dir", str(reports), "-q"]
    run = _run(
        [sys.executable, "-m", "conformance", *args, "--expectations-dir", str(exp)]
        + ["-p", "no:cacheprovider", "conformance/checks/fuzz/fuzz.py::train_parity"],
        cwd=ROOT,
        env={**os.environ, "FSDP_CONFORMANCE_FUZZ_SHRINK_SECONDS": "0"},  # the first failure
    )
    (record,) = [
        c
        for c in json.loads((reports / "conformance.json").read_text())["cases"]
        if c["id"] == "fuzz::train_parity[ws2]"
    ]
    assert record["outcome"] == "xfail", record["message"][-2000:]
    assert run.returncode == 0, run.stdout[-3000:]


def _has_zero(example) -> bool:
    return any(p.numel() == 0 for p in fm.build(example).parameters())


def test_shrinking_drops_an_unneeded_zero_leaf():
    """Issue 26, point 3: a failure that needs no zero-size parameter (here: three steps, three
    non-empty parameters, mixed precision) shrinks to an example without the extra zero-size leaf
    (ZERO_SHARE shrinks toward "no leaf"); one that needs it keeps it."""
    from hypothesis import HealthCheck, find

    impl = load_implementation("reference")
    quiet = settings(database=None, suppress_health_check=list(HealthCheck), max_examples=3000)
    non_empty = lambda e: sum(1 for p in fm.build(e).parameters() if p.numel())  # noqa: E731
    for what, fails in (
        ("three steps", lambda e: e["steps"] == 3),
        ("three parameters", lambda e: non_empty(e) >= 3),
        ("mixed precision", lambda e: bool(e["options"].get("mixed_precision"))),
    ):
        smallest = find(fs.examples(2, impl, fs.ALL_FEATURES), fails, settings=quiet)
        assert not _has_zero(smallest), (what, smallest["tree"])
    needed = find(fs.examples(2, impl, fs.ALL_FEATURES), _has_zero, settings=quiet)
    assert _has_zero(needed), needed["tree"]
