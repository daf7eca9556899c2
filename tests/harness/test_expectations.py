"""Expectations pin their failure: the entry syntax, failure signatures, garbage rejected at start,
and every shipped entry pinned."""

import json
import traceback

import pytest

from conformance import expectations
from conformance.runner.protocol import RankResult
from tests.harness.test_cli import FAKE_ON_SELFCHECKS, run_conformance


def _traceback_of(exc: BaseException) -> str:
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        return traceback.format_exc()


def test_exception_of_reads_the_last_exception_of_a_chained_traceback():
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise AssertionError("rank 0: expected 3\nbut got 4") from inner
    except AssertionError:
        text = traceback.format_exc()
    text += "\n(rank 0 had returned; its stack at teardown:)\nThread 0x1:\n  File x, line 1\n"
    assert expectations.exception_of(text) == ("AssertionError", "rank 0: expected 3\nbut got 4")
    assert expectations.exception_of(_traceback_of(NotImplementedError())) == (
        "NotImplementedError",
        "",
    )
    assert expectations.exception_of("no traceback here") == ("", "no traceback here")


def test_entry_syntax_and_matching():
    (pinned, only_match, unpinned) = expectations.parse(
        "# comment\n"
        "a::b[ws*-x raises=RuntimeError|ValueError match=/size 0 \\/ 2/   why it fails (pytorch#1)\n"
        "a::c\tmatch=/got 4/ the reason\n"
        "a::d  raises are not parsed inside a reason\n",
        "f.txt",
    )
    assert pinned.raises == ("RuntimeError", "ValueError") and pinned.match.pattern == "size 0 / 2"
    assert pinned.reason == "why it fails (pytorch#1)" and pinned.source == "f.txt:2"
    assert only_match.raises == () and only_match.reason == "the reason" and only_match.pinned
    assert not unpinned.pinned and unpinned.reason == "raises are not parsed inside a reason"
    assert "unpinned" in unpinned.signature()

    failed = expectations.failures(
        [
            RankResult(0, "ok"),
            RankResult(1, "error", detail=_traceback_of(RuntimeError("storage of size 0 / 2"))),
            RankResult(2, "timeout", detail="rank 2 did not finish within 5 s; its stack: ..."),
            RankResult(3, "abandoned"),
        ]
    )
    assert [(f.rank, f.kind) for f in failed] == [(1, "RuntimeError"), (2, "timeout")]
    assert pinned.mismatch(failed) is None  # rank 1 fits
    assert unpinned.mismatch(failed) is None
    why = only_match.mismatch(failed)
    assert "pattern /got 4/ not found" in why and "rank 1" in why and "rank 2" in why
    (wrong_type,) = expectations.parse("a::b raises=AssertionError r", "f.txt")
    assert "expected AssertionError, got RuntimeError" in wrong_type.mismatch(failed)
    (hang,) = expectations.parse("a::b raises=timeout|died match=/did not finish/ r", "f.txt")
    assert hang.mismatch(failed) is None
    (qualified,) = expectations.parse("a::b raises=DistBackendError r", "f.txt")
    dist = expectations.failures(
        [
            RankResult(
                0,
                "error",
                detail="Traceback (most recent call last):\n  File x\n"
                "torch.distributed.DistBackendError: boom\n",
            )
        ]
    )
    assert qualified.mismatch(dist) is None


@pytest.mark.parametrize(
    "line, says",
    [
        ("selftest::passes", "has no reason"),
        ("garbage", "'garbage' is not a case-id prefix"),
        ("selftest_passes because", "is not a case-id prefix"),
        ("selftest::passes match=/(unclosed/ reason", "not a valid regular expression"),
        ("selftest::passes match=/no end reason", "needs a closing '/'"),
        ("selftest::passes raises=Not-A-Name reason", "give exception class names"),
        ("selftest::passes raise=RuntimeError reason", "write raises=<ExceptionName>"),
        ("selftest::passes torch<2.x reason", "'<2.x' is not <op><version>"),
        ("selftest::passes torch~=2.14 reason", "'~=2.14' is not <op><version>"),
        ("selftest::passes torch>=2.14.* reason", "'.*' goes with == or != only"),
        ("selftest::passes torch<3 torch>1 reason", "two torch version markers"),
        ("selftest::passes torch>=2.14", "has no reason"),
    ],
)
def test_garbage_line_is_a_usage_error_naming_file_and_line(tmp_path, line, says):
    (tmp_path / "fake.txt").write_text("# header\n\n" + line + "\n")
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS,
        "--expectations-dir",
        str(tmp_path),
        "--world-sizes",
        "2",
        "--reports-dir",
        str(tmp_path / "r"),
        "-k",
        "selftest and passes",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"{tmp_path / 'fake.txt'}:3:" in out and says in out, out
    assert "Traceback" not in out


def test_random_bytes_file_is_a_usage_error(tmp_path):
    (tmp_path / "fake.txt").write_bytes(bytes(range(256)) * 4)
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS,
        "--expectations-dir",
        str(tmp_path),
        "--world-sizes",
        "2",
        "--reports-dir",
        str(tmp_path / "r"),
        "-k",
        "selftest and passes",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and str(tmp_path / "fake.txt") in out and "not UTF-8" in out, out


def _run(tmp_path, lines):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "fake.txt").write_text("\n".join(lines) + "\n")
    proc = run_conformance(
        *FAKE_ON_SELFCHECKS,
        "--expectations-dir",
        str(tmp_path / "exp"),
        "--world-sizes",
        "2",
        "--reports-dir",
        str(tmp_path / "r"),
        "-k",
        "fails_on_rank1 or exits_on_rank1 or passes",
    )
    report = json.loads((tmp_path / "r" / "conformance.json").read_text())
    return proc, {c["check"]: c for c in report["cases"]}


def test_signature_that_fits_is_xfail_and_one_that_does_not_is_a_failure(tmp_path):
    proc, cases = _run(
        tmp_path,
        [
            "selftest::fails_on_rank1 raises=AssertionError match=/expected 0, got 1/  on purpose",
            "selftest::exits_on_rank1 raises=AssertionError  documented as an assertion",
            "selftest::passes   unpinned, and it passes",
        ],
    )
    assert proc.returncode == 1, proc.stdout
    assert cases["fails_on_rank1"]["outcome"] == "xfail", cases["fails_on_rank1"]
    assert "raises=AssertionError match=/expected 0, got 1/" in cases["fails_on_rank1"]["message"]
    died = cases["exits_on_rank1"]
    assert died["outcome"] == "fail", died
    assert (
        "fake.txt:2" in died["message"] and "expected AssertionError, got died" in died["message"]
    )
    assert cases["passes"]["outcome"] == "fail" and "unpinned" in cases["passes"]["message"]


def test_pattern_not_found_is_a_failure_and_a_death_can_be_expected(tmp_path):
    proc, cases = _run(
        tmp_path,
        [
            "selftest::fails_on_rank1 raises=AssertionError match=/got 2/  documented with another value",
            "selftest::exits_on_rank1 raises=died match=/code 7/  exits on purpose",
        ],
    )
    wrong = cases["fails_on_rank1"]
    assert wrong["outcome"] == "fail" and "pattern /got 2/ not found" in wrong["message"], wrong
    assert cases["exits_on_rank1"]["outcome"] == "xfail", cases["exits_on_rank1"]


def test_version_marker_syntax_and_which_torch_it_admits():
    older, newer, wildcard, both, word = expectations.parse(
        "a::b torch<2.14 raises=AssertionError match=/x y/  fixed in 2.14\n"
        "a::b raises=UserWarning torch>=2.14 match=/warns/  2.14 warns\n"
        "a::c torch==2.14.*  only 2.14.x\n"
        "a::d torch>=2.12,!=2.13.0 raises=E  two clauses\n"
        "a::e raises=E torch keeps no rows (not a marker: no operator)\n",
        "f.txt",
    )
    assert str(older.torch) == "torch<2.14" and older.raises == ("AssertionError",)
    assert older.match.pattern == "x y" and older.reason == "fixed in 2.14"
    assert newer.raises == ("UserWarning",) and newer.match.pattern == "warns"
    assert not wildcard.pinned and "torch==2.14.* unpinned" in wildcard.signature()
    assert word.torch is None and word.reason == "torch keeps no rows (not a marker: no operator)"
    admits = {
        v: [e.applies(v) for e in (older, newer, wildcard, both, word)]
        for v in ("2.12.1", "2.13.0+cpu", "2.14.0a0+git0abc", "2.14.1", "2.15.0.dev20260101")
    }
    assert admits == {
        "2.12.1": [True, False, False, True, True],
        "2.13.0+cpu": [True, False, False, False, True],  # local part ignored
        "2.14.0a0+git0abc": [False, True, True, True, True],  # a 2.14 pre-release counts as 2.14
        "2.14.1": [False, True, True, True, True],
        "2.15.0.dev20260101": [False, True, False, True, True],
    }


def test_load_leaves_out_entries_for_another_torch(tmp_path):
    (tmp_path / "impl.txt").write_text(
        "a::b torch<2.14 raises=E  before\na::b torch>=2.14 raises=F  after\na::c raises=G  any\n"
    )
    (tmp_path / "impl.cpu.txt").write_text("a::d torch==2.13.* raises=H  cpu, 2.13 only\n")
    old = expectations.load("impl", "cpu", tmp_path, torch_version="2.13.0+cpu")
    new = expectations.load("impl", "cpu", tmp_path, torch_version="2.14.1")
    assert [e.raises for e in old.entries] == [("E",), ("G",), ("H",)]
    assert [e.raises for e in new.entries] == [("F",), ("G",)]
    assert [e.raises for e in new.other_torch] == [("E",), ("H",)]
    assert old.match("a::b[ws2]").raises == ("E",) and new.match("a::b[ws2]").raises == ("F",)


def test_entry_for_another_torch_neither_matches_nor_is_stale(tmp_path):
    """A marker that excludes the running torch takes the entry out of the run; the entry for the
    running torch (the opposite marker) pins the case. The excluded stale-looking entry is quiet."""
    proc, cases = _run(
        tmp_path,
        [
            "selftest::fails_on_rank1 torch<1.0 raises=KeyError  this torch is not below 1.0",
            "selftest::fails_on_rank1 torch>=1.0 raises=AssertionError match=/expected 0, got 1/  "
            "fails on purpose",
            "selftest::exits_on_rank1 raises=died  exits on purpose",
            "selftest::no_such_check torch<1.0 raises=KeyError  for a torch that is not running",
            "selftest::passes torch<1.0  would fail the run if it applied (the case passes)",
        ],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cases["fails_on_rank1"]["outcome"] == "xfail", cases["fails_on_rank1"]
    assert "torch>=1.0 raises=AssertionError" in cases["fails_on_rank1"]["message"]
    assert cases["passes"]["outcome"] == "pass"
    report = json.loads((tmp_path / "r" / "conformance.json").read_text())
    assert report["stale_expectations"] == [], report["stale_expectations"]
    assert "no_such_check" not in proc.stdout + proc.stderr


def test_every_shipped_entry_is_pinned():
    unpinned = [
        f"{e.source}: {e.prefix}"
        for path in sorted(expectations.DEFAULT_DIR.glob("*.txt"))
        for e in expectations.read(path)
        if not e.pinned
    ]
    assert not unpinned, "shipped expectations without raises=/match=:\n" + "\n".join(unpinned)


def test_inherit_adopts_one_upstream_entry_by_its_prefix(tmp_path):
    """``inherit torch-fsdp2 <prefix>`` in an implementation's own file adopts exactly the base's
    entries with that prefix (not the base's other entries, and without ``inherits``); the
    adopted entry keeps the base's signature and source and says where it was adopted; a prefix
    the base does not list stops the run naming the line (issue 26)."""
    from types import SimpleNamespace

    from conformance import deviations

    prefix = "layout::per_param_dim0_local_shard[ws*-zero-trailing-"
    (tmp_path / "not-a-fork.txt").write_text(
        f"# shares one deviation\ninherit torch-fsdp2 {prefix}\n"
    )
    impl = SimpleNamespace(name="not-a-fork", inherits=None)
    got = deviations.expectations_for(impl, "cpu", tmp_path)
    upstream = [e for e in expectations.load("torch-fsdp2", "cpu").entries if e.prefix == prefix]
    assert upstream and [e.prefix for e in got.entries] == [prefix] * len(upstream)
    (entry,) = got.entries[:1]
    assert entry.source == upstream[0].source and entry.raises == upstream[0].raises
    assert entry.reason.endswith(f"(inherited by {tmp_path / 'not-a-fork.txt'}:2)"), entry.reason
    assert got.match("layout::per_param_dim0_local_shard[ws2-zero-trailing-x]") is not None
    assert got.match("strict::noncontiguous_parameter[ws2-transposed]") is None  # not adopted

    (tmp_path / "not-a-fork.txt").write_text("inherit torch-fsdp2 layout::no_such_check[\n")
    with pytest.raises(expectations.ExpectationsError, match=r"not-a-fork.txt:1: inherit"):
        deviations.expectations_for(impl, "cpu", tmp_path)
    with pytest.raises(expectations.ExpectationsError, match="write 'inherit <implementation>"):
        expectations.parse_all("inherit torch-fsdp2\n", "f.txt")


def test_ws_n_plus_matches_every_world_size_from_n():
    """``[ws2+`` in a prefix is world size 2 and every larger one (issue 26: "every world size from
    2"), ``[ws*`` every world size; the rest of the prefix still has to match."""
    (from2,) = expectations.parse("layout::x[ws2+-zero raises=E r\n", "f.txt")
    cases = {"x[ws1-zero]": False, "x[ws2-zero]": True, "x[ws4-zero-y]": True, "x[ws12-zero]": True}
    got = {c: from2.matches("layout::" + c) for c in cases}
    assert got == cases and not from2.matches("layout::x[ws3-one]"), got
    (every,) = expectations.parse("layout::x[ws*-zero raises=E r\n", "f.txt")
    assert every.matches("layout::x[ws1-zero]") and every.matches("layout::x[ws3-zero]")
