"""Isolation between checks (conformance/runner/isolation.py, [Note: isolation between checks]):
what a check leaves behind is reported and put back, so the next check's outcome does not depend
on what ran before it."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - as in a worker (preloaded there): imports during a check are exempt
import torch.distributed as dist
import torch.utils._device  # noqa: F401

from conformance.runner import isolation

ROOT = Path(__file__).resolve().parents[2]
CHECKS = "tests/harness/isolation_checks"
LEAKS = f"{CHECKS}/leaks.py"


def run(args, tmp_path, name):
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--check-dir", CHECKS, "--reports-dir", str(out),
         "-q", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, "FSDP_ISOLATION_TEST_CWD": str(ROOT), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    report = out / "conformance.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(report.read_text())["cases"]
    return proc, {(c["impl"], c["id"]): c for c in cases}


def test_a_leaking_check_does_not_change_the_next_ones_outcome(tmp_path):
    """The issue's measurement: a check that sets the default dtype to float64, disables grad
    mode, sets an environment variable (and more), next to one that needs them clean, in both
    orders (sensitive, leaking, sensitive, leaking) at world sizes 1 and 2, after a check that
    leaves inference mode entered (the group is restarted): the sensitive check passes every
    time, the leaking ones fail with what they changed every time. Before the isolation the
    sensitive one failed after the leaking ones (inherited state)."""
    ids = [
        ids
        for ws in (1, 2)
        for ids in [f"{LEAKS}::leaves_inference_mode[fake-ws{ws}]"]
        + [
            f"{LEAKS}::{name}[fake-ws{ws}-{case}]"
            for case in ("first", "second")
            for name in ("needs_clean_state", "leaks_global_state")
        ]
    ]
    proc, cases = run(
        ["--impl", "tests.harness.fake_impl:FakeImpl", "--world-sizes", "1,2", *ids],
        tmp_path,
        "orders",
    )
    assert len(cases) == 10, proc.stdout[-3000:]
    for ws in (1, 2):
        stuck = cases[("fake", f"isolation::leaves_inference_mode[ws{ws}]")]
        assert stuck["outcome"] == "fail", stuck
        assert "state leaked: inference mode False -> True" in stuck["message"], stuck
        for case in ("first", "second"):
            sensitive = cases[("fake", f"isolation::needs_clean_state[ws{ws}-{case}]")]
            assert sensitive["outcome"] == "pass", sensitive["message"]
            leaky = cases[("fake", f"isolation::leaks_global_state[ws{ws}-{case}]")]
            assert leaky["outcome"] == "fail", leaky
            for change in (
                "state leaked: default dtype torch.float32 -> torch.float64",
                "state leaked: grad mode True -> False",
                "state leaked: environment variable FSDP_ISOLATION_TEST_LEAK unset -> '1'",
                "state leaked: working directory ",
                "state leaked: torch.nn.modules.module._global_forward_pre_hooks added",
                "state leaked: torch.distributed.all_reduce replaced",
                "state leaked: deterministic algorithms (False, False) -> (True, True)",
            ):
                assert change in leaky["message"], (change, leaky["message"])
            assert all(r["status"] == "error" for r in leaky["ranks"]), leaky["ranks"]
    spawns = json.loads((tmp_path / "orders" / "conformance.json").read_text())
    # restarted once per world size, after the inference mode it could not leave; the
    # other leaks were put back in place
    assert spawns["process_group_spawns"] == {"1": 2, "2": 2}, spawns["process_group_spawns"]
    assert proc.returncode == 1, proc.stdout[-2000:]


def test_an_implementation_declares_its_once_only_global_hook(tmp_path):
    """An adapter that lists the hook registry in ``allowed_global_state`` may register a global
    module hook once; the same adapter without the declaration fails with the leak."""
    impls = "tests.harness.isolation_impl:HookOnceDeclared,tests.harness.isolation_impl:HookOnceUndeclared"
    proc, cases = run(
        ["--impl", impls, "--world-sizes", "1", f"{LEAKS}::implementation_hooks_once"],
        tmp_path,
        "declared",
    )
    declared = cases[("hook-once-declared", "isolation::implementation_hooks_once[ws1]")]
    undeclared = cases[("hook-once-undeclared", "isolation::implementation_hooks_once[ws1]")]
    assert declared["outcome"] == "pass", declared["message"]
    assert undeclared["outcome"] == "fail", undeclared
    assert (
        "StateLeak: state leaked: torch.nn.modules.module._global_forward_pre_hooks added"
        in undeclared["message"]
    ), undeclared["message"]


# -- the snapshot itself, in this process ---------------------------------------------------


@pytest.fixture
def clean():
    """A snapshot of this process's state, put back after the test whatever it did."""
    before = isolation.snapshot()
    yield before
    isolation.settle(before)


def test_every_kind_of_leak_is_reported_and_put_back(clean, tmp_path):
    original_all_reduce = dist.all_reduce
    cwd = os.getcwd()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_anomaly_enabled(True)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    os.environ["FSDP_ISOLATION_UNIT"] = "x"
    os.chdir(tmp_path)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    optimizer = sys.modules["torch.optim.optimizer"]
    optimizer.register_optimizer_step_pre_hook(lambda opt, a, k: None)
    dist.all_reduce = lambda *a, **k: None
    torch.set_default_device("meta")
    outcome = isolation.settle(clean)
    text = outcome.message()
    for label in (
        "default dtype torch.float32 -> torch.float64",
        "grad mode True -> False",
        "anomaly mode (False, True) -> (True, True)",
        "deterministic algorithms (False, False) -> (True, False)",
        "float32 matmul precision 'highest' -> 'medium'",
        "environment variable FSDP_ISOLATION_UNIT unset -> 'x'",
        f"working directory {cwd!r} -> {str(tmp_path)!r}",
        "torch.nn.modules.module._global_forward_hooks added",
        "torch.optim.optimizer._global_optimizer_pre_hooks added",
        "torch.distributed.all_reduce replaced",
        "default device cpu -> meta",
    ):
        assert f"state leaked: {label}" in text, (label, text)
    assert text.startswith("Traceback") and "\nStateLeak: state leaked:" in text
    # all of it put back
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert not torch.is_anomaly_enabled() and not torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
    assert "FSDP_ISOLATION_UNIT" not in os.environ and os.getcwd() == cwd
    assert handle.id not in torch.nn.modules.module._global_forward_hooks
    assert not optimizer._global_optimizer_pre_hooks
    assert dist.all_reduce is original_all_reduce
    assert torch.get_default_device() == torch.device("cpu") and torch.ones(1).device.type == "cpu"
    assert not outcome.recycle, "everything here can be put back"
    assert isolation.settle(clean).leaks == [], "a second look finds nothing left"


def test_rng_states_are_put_back_silently(clean):
    """Every check draws random numbers: no leak, but the next check starts from the same state."""
    expected = torch.rand(3)
    isolation.settle(clean)  # back to the state before the draw
    torch.rand(100)
    random.random()
    outcome = isolation.settle(clean, allowed=("environment variable PYTEST_*",))
    assert outcome.leaks == [] and not outcome.recycle
    assert torch.equal(torch.rand(3), expected)


def test_what_cannot_be_put_back_recycles_the_worker(clean):
    mode = torch.inference_mode()
    mode.__enter__()
    try:
        outcome = isolation.settle(clean)
    finally:
        mode.__exit__(None, None, None)
    assert "state leaked: inference mode False -> True" in outcome.message()
    assert outcome.recycle


def test_allowed_labels_are_neither_reported_nor_undone(clean):
    os.environ["FSDP_ISOLATION_ALLOWED"] = "1"
    torch.set_default_dtype(torch.float64)
    allowed = ("environment variable FSDP_ISOLATION_A*", "environment variable PYTEST_*")
    outcome = isolation.settle(clean, allowed=allowed)
    assert outcome.leaks == ["default dtype torch.float32 -> torch.float64"]
    assert os.environ.pop("FSDP_ISOLATION_ALLOWED") == "1"


def test_an_import_during_the_check_may_set_itself_up(clean, tmp_path, monkeypatch):
    """A module imported for the first time during the check may add environment variables and
    decorate watched functions (what torch._dynamo and torch._inductor do at import)."""
    import functools

    (tmp_path / "iso_setup_module.py").write_text(
        "import functools, os, torch.distributed as dist\n"
        "os.environ.setdefault('FSDP_ISOLATION_IMPORTED', '1')\n"
        "dist.barrier = functools.wraps(dist.barrier)(lambda *a, **k: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    original = dist.barrier
    import iso_setup_module  # noqa: F401

    outcome = isolation.settle(clean, allowed=("environment variable PYTEST_*",))
    assert outcome.leaks == [], outcome.leaks
    assert dist.barrier.__wrapped__ is original
    dist.barrier = original
    del os.environ["FSDP_ISOLATION_IMPORTED"]
    sys.modules.pop("iso_setup_module")
    assert functools  # (the module above imports it too)


def test_the_snapshot_is_cheap(clean):
    """Both halves together, per check per rank: the target is well under the 5 % of a check's
    typical 0.1-1 s (docs/running.md, "Isolation between checks")."""
    import time

    start = time.perf_counter()
    for _ in range(50):
        isolation.settle(isolation.snapshot())
    per_check = (time.perf_counter() - start) / 50
    assert per_check < 0.02, f"snapshot + settle took {per_check * 1e3:.1f} ms"


# -- order independence ---------------------------------------------------------------------


class _Item:
    def __init__(self, nodeid, ws):
        self.nodeid, self.ws = nodeid, ws


def test_shuffle_draws_each_world_sizes_order_from_the_seed_alone():
    from conformance.plugin import shuffled

    ws = lambda it: it.ws  # noqa: E731
    items = [_Item(f"c{i}[ws{w}]", w) for w in (1, 2) for i in range(30)]
    one = shuffled(items, 1, ws)
    assert sorted(it.nodeid for it in one) == sorted(it.nodeid for it in items)
    assert [it.ws for it in one] == [it.ws for it in items], "world sizes keep their slots"
    assert [it.nodeid for it in one] != [it.nodeid for it in items]
    again = shuffled(list(reversed(items)), 1, ws)
    ws1 = lambda seq: [it.nodeid for it in seq if it.ws == 1]  # noqa: E731
    assert ws1(again) == ws1(one), "the collection order does not matter"
    assert ws1(shuffled([it for it in items if it.ws == 1], 1, ws)) == ws1(one), (
        "nor the other world sizes selected"
    )
    assert ws1(shuffled(items, 2, ws)) != ws1(one)


def test_the_order_comparison_names_every_case_that_differs(tmp_path):
    from conformance.runner import order

    def report(name, outcomes):
        cases = [
            {"impl": "reference", "id": f"a::{c}[ws{w}]", "world_size": w, "outcome": o}
            for (c, w), o in outcomes.items()
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"cases": cases}))
        return str(path)

    first = report("a.json", {("x", 1): "pass", ("y", 1): "fail", ("z", 2): "pass"})
    same = report("b.json", {("y", 1): "fail", ("x", 1): "pass"})
    other = report("c.json", {("x", 1): "fail", ("y", 1): "fail", ("w", 1): "pass"})
    assert order.main([first, same, "--world-size", "1"]) == 0
    assert order.main([first, same]) == 1  # z at ws2 ran once only
    assert order.differences(order.outcomes(first, 1), order.outcomes(other, 1)) == [
        "a::w[ws1] on reference: not run -> pass",
        "a::x[ws1] on reference: pass -> fail",
    ]
    assert order.main([first, str(tmp_path / "missing.json")]) == 2


def test_shuffle_reorders_the_collected_cases():
    """End to end through pytest's collection (the draw itself is tested above)."""

    def collected(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "conformance", "--impl", "tests.harness.fake_impl:FakeImpl",
             "--check-dir", "tests/harness/hostile_checks", "--world-sizes", "1,2",
             "tests/harness/hostile_checks/hostile.py", "--collect-only", "-q", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return [ln for ln in proc.stdout.splitlines() if "::" in ln]

    plain, one = collected(), collected("--shuffle", "3")
    assert len(plain) == 8 and sorted(plain) == sorted(one) and plain != one, (plain, one)
    assert ["ws1" in ln for ln in one] == ["ws1" in ln for ln in plain], "grouped by world size"
