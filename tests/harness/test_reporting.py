"""The terminal/markdown matrix built from case records."""

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


def test_repro_carries_every_option_that_changes_the_outcome(monkeypatch):
    from types import SimpleNamespace

    from conformance import options
    from conformance.reporting import repro_command, rerun_options

    monkeypatch.setenv("FSDP_CONFORMANCE_TORCH", "/wheels/torch 2.14.whl")
    opt = SimpleNamespace(
        expectations_dir="my-exp", check_dir=["my_checks"], respawn_every_check=False
    )
    validated = options.Options(
        impl_specs=["my.fork:Adapter"], world_sizes=[2], device="cpu", backend="gloo",
        check_timeout=15.0, grace=5.0, threads_per_rank=2, expectations_dir=options.Path("my-exp"),
        check_dirs=[], reports_dir=None,
    )  # fmt: skip
    meta = SimpleNamespace(
        impl_spec="my.fork:Adapter", world_size=2, device="cpu", backend="gloo",
        nodeid="my_checks/a.py::b[x-ws2]", rerun=rerun_options(opt, validated),
    )  # fmt: skip
    assert repro_command(meta) == (
        "FSDP_CONFORMANCE_TORCH='/wheels/torch 2.14.whl' nox -s conformance -- --impl "
        "my.fork:Adapter --world-sizes 2 --device cpu --backend gloo --expectations-dir my-exp "
        "--check-timeout 15 --threads-per-rank 2 --check-dir my_checks 'my_checks/a.py::b[x-ws2]'"
    )
