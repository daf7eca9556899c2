"""Reports: the matrix built from case records, rerun lines, the fuzz reproducer's exit codes."""

import os
import subprocess
import sys

import pytest

from conformance.reporting import matrix_lines


def _rec(area, impl, ws, outcome):
    return {"area": area, "impl": impl, "world_size": ws, "outcome": outcome}


def test_rows_that_are_not_supported_everywhere_are_folded_under_the_table():
    records = [
        _rec("layout", "a", 1, "pass"), _rec("layout", "a", 2, "fail"),
        _rec("layout", "b", 1, "not-supported"), _rec("layout", "b", 2, "not-supported"),
        _rec("wrap", "b", 1, "not-supported"), _rec("wrap", "b", 2, "xfail"),
        _rec("states", "b", 2, "not-supported"), _rec("states", "c", 1, "not-supported"),
    ]  # fmt: skip
    lines = matrix_lines(records)
    rows = [
        line.split()[:2]
        for line in lines[2:]
        if not line.startswith(("not supported", "legend", "total"))
    ]
    assert rows == [["layout", "a"], ["wrap", "b"]]  # a row with any other outcome stays
    assert "not supported at any world size (rows folded): layout: b; states: b, c" in lines
    assert lines[-1] == "total: 1 pass, 1 fail, 1 xfail, 5 not-supported"


def test_a_matrix_with_nothing_but_not_supported_still_has_its_header():
    lines = matrix_lines([_rec("layout", "b", 1, "not-supported")])
    assert lines[0].split() == ["area", "implementation", "ws1"]
    assert "not supported at any world size (rows folded): layout: b" in lines


def test_a_long_message_keeps_its_end_where_the_cause_is():
    from conformance.reporting import shorten

    text = "frame\n" * 5000 + "ValueError: the real cause"
    short = shorten(text, limit=2000)
    assert len(short) < 2100 and short.endswith("ValueError: the real cause")
    assert short.startswith("frame") and "characters cut" in short
    assert shorten("short") == "short"


def _validated(**kw):
    from conformance import options

    return options.Options(
        **{
            "impl_specs": None, "world_sizes": [2], "device": "cpu", "backend": "gloo",
            "check_timeout": 60.0, "grace": 5.0, "threads_per_rank": 1,
            "expectations_dir": options.Path("conformance/expectations"), "check_dirs": [],
            "reports_dir": None, **kw,
        }
    )  # fmt: skip


def _meta(impl_spec, nodeid, rerun):
    from types import SimpleNamespace

    return SimpleNamespace(
        impl_spec=impl_spec, world_size=2, device="cpu", backend="gloo", nodeid=nodeid, rerun=rerun
    )


def _opt(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(
        **{"expectations_dir": "conformance/expectations", "check_dir": [],
           "respawn_every_check": False, "fuzz_examples": None, **kw}
    )  # fmt: skip


def test_repro_under_nox_carries_every_option_that_changes_the_outcome(monkeypatch):
    from conformance import options
    from conformance.reporting import LAUNCHER_ENV, repro_command, rerun_options

    monkeypatch.setenv(LAUNCHER_ENV, "nox")
    monkeypatch.setenv("FSDP_CONFORMANCE_TORCH", "/wheels/torch 2.14.whl")
    monkeypatch.delenv("FSDP_CONFORMANCE_EXTRA_PIP", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    opt = _opt(expectations_dir="my-exp", check_dir=["my_checks"], fuzz_examples=200)
    validated = _validated(
        check_timeout=15.0, threads_per_rank=2, expectations_dir=options.Path("my-exp")
    )
    rerun = rerun_options(opt, validated, ["reference"])
    assert repro_command(_meta("reference", "my_checks/a.py::b[x-ws2]", rerun)) == (
        "FSDP_CONFORMANCE_TORCH='/wheels/torch 2.14.whl' nox -s conformance -- --impl "
        "reference --world-sizes 2 --device cpu --backend gloo --expectations-dir my-exp "
        "--check-timeout 15 --threads-per-rank 2 --check-dir my_checks --fuzz-examples 200 "
        "'my_checks/a.py::b[x-ws2]'"
    )


def test_repro_of_a_python_m_run_says_python_m_and_carries_the_plugin_path(tmp_path, monkeypatch):
    """A ``python -m conformance`` run is rerun with ``python -m conformance`` (nox's variables mean
    nothing there), with the sys.path entry its plug-in was imported from as PYTHONPATH."""
    from conformance.reporting import LAUNCHER_ENV, python_command, repro_command, rerun_options

    (tmp_path / "my_fork_r").mkdir()
    (tmp_path / "my_fork_r" / "__init__.py").write_text("")
    (tmp_path / "my_fork_r" / "conformance.py").write_text("Adapter = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # added at run time, not through PYTHONPATH
    __import__("my_fork_r.conformance")
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("FSDP_CONFORMANCE_TORCH", "torch==2.14.1")  # not used by python -m
    rerun = rerun_options(_opt(), _validated(), ["reference", "my_fork_r.conformance:Adapter"])
    assert rerun.paths == (str(tmp_path.resolve()),)
    line = repro_command(_meta("my_fork_r.conformance:Adapter", "c.py::t[f-ws2]", rerun))
    assert line == (
        f"PYTHONPATH={tmp_path.resolve()} {python_command()} -m conformance --impl "
        "my_fork_r.conformance:Adapter --world-sizes 2 --device cpu --backend gloo "
        "'c.py::t[f-ws2]'"
    )
    # a built-in needs no path; this directory and PYTHONPATH entries that are it are left out
    monkeypatch.setenv("PYTHONPATH", f".{os.pathsep}")
    assert rerun_options(_opt(), _validated(), ["reference"]).paths == ()


def _example():
    from hypothesis import HealthCheck, find, settings

    from conformance.adapters.registry import load_implementation
    from conformance.fuzz import strategies as fs

    return find(
        fs.examples(1, load_implementation("reference")),
        lambda _: True,
        settings=settings(database=None, suppress_health_check=list(HealthCheck)),
    )


@pytest.fixture(scope="module")
def example():
    return _example()


def _script(tmp_path, example, check, paths, impl="my_fork_s:Adapter", world_size=1):
    from types import SimpleNamespace

    from conformance.fuzz import repro
    from conformance.reporting import Rerun

    meta = SimpleNamespace(
        case_id=f"fuzz::x[ws{world_size}]", impl_name="my-fork", impl_spec=impl,
        spec=SimpleNamespace(path=f"tests.harness.repro_checks:{check}", cases={"": {}}),
        case="", world_size=world_size, device="cpu", backend="gloo", rerun=Rerun(paths=paths),
    )  # fmt: skip
    script = tmp_path / f"repro_{check}_{len(paths)}_{impl.partition(':')[0]}.py"
    script.write_text(repro.snippet(meta, example))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor the plug-in's directory
    elsewhere.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(script)], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.fixture
def plugin_dir(tmp_path):
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "my_fork_s.py").write_text("from tests.harness.fake_impl import FakeImpl as Adapter\n")
    return plug


def test_repro_script_exit_codes_reproduces_passes_could_not_start(tmp_path, plugin_dir, example):
    """The script carries the run's import path (the plug-in's directory is found from another
    directory without PYTHONPATH) and tells its three endings apart: 1 reproduces, 0 passes,
    2 could not start."""
    from conformance.fuzz.repro import COULD_NOT_START, PASSES, REPRODUCES

    assert (REPRODUCES, PASSES, COULD_NOT_START) == (1, 0, 2)
    paths = (str(plugin_dir),)
    failing = _script(tmp_path, example, "fails_on_last_rank", paths, world_size=2)
    assert failing.returncode == REPRODUCES, failing.stderr[-3000:]
    assert "[rank 1] rejects the example on purpose" in failing.stderr
    assert "reproduces: rank 1 failed" in failing.stderr
    passing = _script(tmp_path, example, "passes", paths)
    assert passing.returncode == PASSES, passing.stderr[-3000:]
    assert "passed: the example does not reproduce here" in passing.stdout
    # without the plug-in's path, or with an adapter that cannot be loaded: nothing was checked
    for carried, impl, cause in (
        ((), "my_fork_s:Adapter", "No module named 'my_fork_s'"),
        (paths, "tests.harness.fake_impl:broken", "this factory is broken on purpose"),
    ):
        alone = _script(tmp_path, example, "fails_on_last_rank", carried, impl=impl)
        assert alone.returncode == COULD_NOT_START, alone.stderr[-3000:]
        assert "could not start: rank 0 failed before the check ran" in alone.stderr
        assert cause in alone.stderr, alone.stderr[-3000:]
