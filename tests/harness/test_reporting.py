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
    rows = [line.split()[:2] for line in lines[2:] if not line.startswith(("not supported", "legend", "total"))]
    assert rows == [["layout", "a"], ["wrap", "b"]]  # a row with any other outcome stays
    assert "not supported at any world size (rows folded): layout: b; states: b, c" in lines
    assert lines[-1] == "total: 1 pass, 1 fail, 1 xfail, 5 not-supported"


def test_a_matrix_with_nothing_but_not_supported_still_has_its_header():
    lines = matrix_lines([_rec("layout", "b", 1, "not-supported")])
    assert lines[0].split() == ["area", "implementation", "ws1"]
    assert "not supported at any world size (rows folded): layout: b" in lines
