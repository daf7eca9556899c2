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


def test_every_shipped_entry_is_pinned():
    unpinned = [
        f"{e.source}: {e.prefix}"
        for path in sorted(expectations.DEFAULT_DIR.glob("*.txt"))
        for e in expectations.read(path)
        if not e.pinned
    ]
    assert not unpinned, "shipped expectations without raises=/match=:\n" + "\n".join(unpinned)
