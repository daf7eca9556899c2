"""Out-of-tree forks: Acme (``tests/forks/acme_fsdp``, loaded by entry point) is upstream torch FSDP
under other names, in another package. Declaring the base it keeps (``inherits``) gives it the
base's known deviations (expectation entries, fuzz drops and steers), so it runs clean and shows
them as expected failures; without a base each such failure names the deviation and how to
inherit it. A fork whose wrapper inserts its own attribute into names needs only ``clean_fqn``; a
fork that runs on CUDA only is refused at the start of a CPU run, in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings

from conformance import expectations
from conformance.adapters import FullyShardAdapter, base
from conformance.adapters.registry import (
    ImplementationLoadError,
    lineage,
    load_implementation,
)
from conformance.fuzz import dropped
from conformance.fuzz import model as fm
from conformance.fuzz import strategies as fs

ROOT = Path(__file__).resolve().parents[2]
FORKS = ROOT / "tests" / "forks"  # holds acme_fsdp/ and acme_fsdp-0.1.dist-info/


@pytest.fixture
def acme(monkeypatch):
    """Acme installed for this process: its dist-info (entry points) on the import path."""
    monkeypatch.syspath_prepend(str(FORKS))


def _conformance(tmp_path, impls: str, world_sizes: str, *select: str, env=None):
    """``python -m conformance`` with Acme (and Parax) on PYTHONPATH; (process, cases by id per
    impl). ``env``: more environment variables."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(FORKS), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    )
    reports = tmp_path / "reports"
    args = ["--impl", impls, "--world-sizes", world_sizes, "--reports-dir", str(reports), "-q"]
    run = subprocess.run(
        [sys.executable, "-m", "conformance", *args, "-p", "no:cacheprovider", *select],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    cases = {}
    report = reports / "conformance.json"
    if report.exists():
        for case in json.loads(report.read_text())["cases"]:
            cases[(case["impl"], case["id"])] = case
    return run, cases


def _listed(base_name: str, case_id: str) -> bool:
    return expectations.load(base_name, "cpu").match(case_id) is not None


# cases where torch 2.13 has known deviations at ws 1-2, plus every fuzz case
DEVIATIONS = (
    "fuzz or zero_numel_param_round_trip or per_param_dim0_local_shard or "
    "gradient_divide_factor or flat_param_shard"
)


def test_renamed_upstream_forks_run_clean_with_their_bases_deviations(tmp_path):
    """acme-fsdp2 / acme-fsdp1 (upstream under Acme's names, declaring ``inherits``) fail nothing
    at ws 1-2 on the fuzz area and on cases with known upstream deviations, and their expected
    failures are exactly the cases their base's shipped expectations list."""
    run, cases = _conformance(tmp_path, "acme-fsdp2,acme-fsdp1", "1,2", "-k", DEVIATIONS)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for impl, base_name in (("acme-fsdp2", "torch-fsdp2"), ("acme-fsdp1", "torch-fsdp1")):
        mine = {cid: c for (i, cid), c in cases.items() if i == impl}
        fuzz = [c for cid, c in mine.items() if cid.startswith("fuzz::")]
        assert len(fuzz) == 12 and not [c for c in fuzz if c["outcome"] == "fail"], impl
        assert sum(c["outcome"] == "pass" for c in fuzz) >= 8, [c["outcome"] for c in fuzz]
        xfail = {cid for cid, c in mine.items() if c["outcome"] == "xfail"}
        listed = {cid for cid, c in mine.items() if _listed(base_name, cid)}
        assert xfail and xfail == listed, (impl, sorted(xfail ^ listed))


def test_fork_without_a_base_is_told_which_deviation_it_met(tmp_path):
    """The same forks with no ``inherits`` fail exactly where the base's expectations list a case,
    and each failure names the base's entry and how to inherit it; the other cases pass."""
    select = "zero_numel_param_round_trip or per_param_dim0_local_shard or gradient_divide_factor"
    run, cases = _conformance(tmp_path, "acme-fsdp2-bare,acme-fsdp1-bare", "2", "-k", select)
    assert run.returncode == 1, run.stdout[-3000:]
    for impl, base_name in (("acme-fsdp2-bare", "torch-fsdp2"), ("acme-fsdp1-bare", "torch-fsdp1")):
        mine = {cid: c for (i, cid), c in cases.items() if i == impl}
        failed = {cid for cid, c in mine.items() if c["outcome"] == "fail"}
        listed = {cid for cid in mine if _listed(base_name, cid)}
        assert failed and failed == listed, (impl, sorted(failed ^ listed))
        for cid in failed:
            message = mine[cid]["message"]
            entry = expectations.load(base_name, "cpu").match(cid)
            assert f'set `inherits = "{base_name}"`' in message, message[-1500:]
            assert entry.source in message and entry.reason in message, message[-1500:]
        assert all(mine[c]["outcome"] in ("pass", "not-supported") for c in set(mine) - failed)


def _examples(impl, check_fn, case: str, ws: int, n: int) -> list[dict]:
    features = check_fn.fuzz_features.difference(
        *(d.features for d in dropped(check_fn.fuzz_drops, case, impl))
    )
    drawn = []

    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(fs.examples(ws, impl, features))
    def draw(example):
        drawn.append(example)

    draw()
    return drawn


def test_an_inheriting_fork_draws_its_bases_examples(acme):
    """Drops and steers follow ``inherits``, not names: acme-fsdp2 draws exactly torch-fsdp2's
    train_parity examples (no zero-numel parameters, no divide factors) and acme-fsdp1 exactly
    torch-fsdp1's SHARDED round-trip examples; the forks without a base draw what the
    references draw (zero-numel parameters among them)."""
    from conformance.checks.fuzz.fuzz import train_parity
    from conformance.checks.fuzz.state_dict import state_dict_round_trip

    def empty(example):
        return any(p.numel() == 0 for p in fm.build(example).parameters())

    for check_fn, case, fork, base_name in (
        (train_parity, "", "acme-fsdp2", "torch-fsdp2"),
        (state_dict_round_trip, "sharded", "acme-fsdp1", "torch-fsdp1"),
    ):
        forked = _examples(load_implementation(fork), check_fn, case, 2, 40)
        assert forked == _examples(load_implementation(base_name), check_fn, case, 2, 40)
        assert not any(empty(e) for e in forked)
        bare = _examples(load_implementation(f"{fork}-bare"), check_fn, case, 2, 40)
        assert bare != forked and any(empty(e) for e in bare), fork


def test_inherits_resolves_transitively_and_rejects_bad_bases(acme):
    class Grandchild(FullyShardAdapter):
        name, inherits = "acme-fsdp2-patched", "acme-fsdp2"

    assert lineage(Grandchild()) == ("acme-fsdp2-patched", "acme-fsdp2", "torch-fsdp2")
    assert fs.steers(Grandchild()) == fs.steers(load_implementation("torch-fsdp2"))
    assert not fs.steers(load_implementation("reference"))
    with pytest.raises(ImplementationLoadError, match="no implementation named 'nope'"):
        lineage(FullyShardAdapter(name="x", inherits="nope"))

    class Loop(FullyShardAdapter):
        name, inherits = "loop-a", "loop-b"

    from conformance.adapters import registry

    registry._LOADED["loop-b"] = FullyShardAdapter(name="loop-b", inherits="loop-a")
    try:
        with pytest.raises(ImplementationLoadError, match="cycle .*loop-a -> loop-b -> loop-a"):
            lineage(Loop())
    finally:
        del registry._LOADED["loop-b"]


def _failed_rank(detail: str):
    from conformance.runner import protocol

    trace = f"Traceback (most recent call last):\n  File 'x.py', line 1, in f\n{detail}\n"
    return [
        SimpleNamespace(rank=0, status=protocol.ERROR, detail=trace, duration=0.1),
        SimpleNamespace(rank=1, status=protocol.OK, detail="", duration=0.1),
    ]


def test_fuzz_failure_of_a_base_deviation_names_the_steer(acme):
    """A fuzz failure that fits a steer or drop of a base the fork does not inherit (torch-fsdp2's
    zero-numel backward, torch-fsdp1's SHARDED ZeroDivisionError) gets the hint; an inheriting
    fork, or a failure of another kind, gets none."""
    from conformance.checks.fuzz.fuzz import train_parity
    from conformance.checks.fuzz.state_dict import state_dict_round_trip
    from conformance.deviations import inherit_hint

    def meta(fn, case=""):
        return SimpleNamespace(
            spec=SimpleNamespace(fn=fn), case=case, case_id="fuzz::x[ws2]", device="cpu"
        )

    chunk = _failed_rank("RuntimeError: _chunk_cat expects non-empty tensor")
    bare, forked = load_implementation("acme-fsdp2-bare"), load_implementation("acme-fsdp2")
    hint = inherit_hint(meta(train_parity), bare, chunk)
    assert 'set `inherits = "torch-fsdp2"`' in hint and fs.NO_ZERO_BACKWARD in hint, hint
    assert inherit_hint(meta(train_parity), forked, chunk) == ""
    other = _failed_rank("AssertionError: [rank 0/2] step 0 loss 1.0 != 2.0")
    assert inherit_hint(meta(state_dict_round_trip, "full"), bare, other) == ""
    zero_div = _failed_rank("ZeroDivisionError: integer division or modulo by zero")
    fsdp1_bare = load_implementation("acme-fsdp1-bare")
    hint = inherit_hint(meta(state_dict_round_trip, "sharded"), fsdp1_bare, zero_div)
    assert 'set `inherits = "torch-fsdp1"`' in hint and "ZeroDivisionError" in hint, hint
    assert inherit_hint(meta(state_dict_round_trip, "full"), fsdp1_bare, zero_div) == ""


def test_a_foreign_wrapper_prefix_needs_only_clean_fqn(tmp_path):
    """Acme's shell stores the FSDP1 model under ``_acme_wrapped``: with ``clean_fqn`` mapping
    that away, state_dict::buffers and ::round_trip pass unchanged (FSDP1's known deviations
    aside); without it (the control) they fail on the buffer names."""
    run, cases = _conformance(
        tmp_path,
        "acme-shell,acme-shell-unclean",
        "2",
        "conformance/checks/state_dict/kinds.py::buffers",
        "conformance/checks/state_dict/kinds.py::round_trip",
    )
    shell = {cid: c for (i, cid), c in cases.items() if i == "acme-shell"}
    assert shell["state_dict::buffers[ws2-full]"]["outcome"] == "pass"
    assert shell["state_dict::round_trip[ws2-full]"]["outcome"] == "pass"
    bad = {cid: c["message"][-300:] for cid, c in shell.items() if c["outcome"] == "fail"}
    assert not bad and len(shell) >= 10, bad
    unclean = {cid: c for (i, cid), c in cases.items() if i == "acme-shell-unclean"}
    for cid in ("state_dict::buffers[ws2-full]", "state_dict::round_trip[ws2-full]"):
        assert unclean[cid]["outcome"] == "fail", unclean[cid]["outcome"]
    assert run.returncode == 1


def test_a_cuda_only_fork_is_refused_on_a_cpu_run_in_one_line(tmp_path):
    """``devices = {"cuda"}`` on a CPU/gloo run: exit 2 before anything runs, one line naming the
    implementation, the device and --device."""
    run, cases = _conformance(tmp_path, "reference,acme-cuda", "1", "-k", "layout")
    assert run.returncode == 2 and not cases, run.stdout[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("fsdp conformance: --device: implementation acme-cuda runs on cuda")
    assert "--device cuda" in lines[0] and "run on cpu" in lines[0], lines[0]


def test_adapter_attributes_are_validated_at_load():
    from conformance.adapters.registry import _validate

    class BadDevices(FullyShardAdapter):
        devices = "cuda"

    class SelfInherit(FullyShardAdapter):
        name, inherits = "me", "me"

    for cls, what in ((BadDevices, "devices='cuda'"), (SelfInherit, "inherits='me'")):
        with pytest.raises(ImplementationLoadError, match=what):
            _validate("spec", cls())
    assert base.Implementation.inherits is None and base.Implementation.devices is None


PARAX_EXPECTATIONS = FORKS / "parax_fsdp" / "expectations"


def test_a_dtensor_fsdp_of_another_design_runs_the_matrix_clean(tmp_path):
    """Parax (``tests/forks/parax_fsdp``: DTensor shards gathered through parametrizations,
    reduce-scattered through functional collectives; not a fork of upstream) runs every check at
    world size 2 with 0 unexpected failures: its expected failures are exactly the cases its own
    expectations file lists. It guards issue 26's harness fixes: its reduce-scatters are seen
    (point 1: every reduce_scatter_dtype case passes), its ``shard`` asserts that no option
    reaches it undeclared (point 4), every not-supported case is worded one way (point 5), and
    its parametrized names reach the checks only through ``clean_fqn``."""
    run, cases = _conformance(
        tmp_path,
        "parax-fsdp",
        "2",
        "--expectations-dir",
        str(PARAX_EXPECTATIONS),
        env={"FSDP_CONFORMANCE_FUZZ_SHRINK_SECONDS": "0"},  # a failure is reported unshrunk
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    mine = {cid: c for (i, cid), c in cases.items() if i == "parax-fsdp"}
    outcomes = {o: sum(c["outcome"] == o for c in mine.values()) for o in ("pass", "fail")}
    assert outcomes["fail"] == 0 and outcomes["pass"] >= 100, outcomes
    listed = expectations.load("parax-fsdp", "cpu", PARAX_EXPECTATIONS)
    xfail = {cid for cid, c in mine.items() if c["outcome"] == "xfail"}
    assert xfail and xfail == {cid for cid in mine if listed.match(cid)}, sorted(xfail)
    rs = [c for cid, c in mine.items() if cid.startswith("mixed_precision::reduce_scatter_dtype")]
    assert len(rs) == 9 and all(c["outcome"] == "pass" for c in rs), [c["outcome"] for c in rs]
    for cid, c in mine.items():
        if c["outcome"] == "not-supported":
            first = c["message"].splitlines()[0]
            assert first.startswith(
                ("NotSupported: parax-fsdp does not declare ", "NotSupported: parax-fsdp: ")
            ), (cid, first)
