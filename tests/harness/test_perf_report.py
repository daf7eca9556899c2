"""The perf report's paired statistics: the median's interval and the "≤ 1.00× upstream" verdict.

Synthetic per-round times go through the suite's own record builder (``perf.conftest.make_record``,
which derives the per-round ratios) and the report (``perf.report.render``). Every expected verdict
is derived from the generated data by a one-sided sign test written here (the dual of an
order-statistics interval), never read off the report.
"""

from __future__ import annotations

import math
import re
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from perf import report
from perf.conftest import Case, TaskResult, make_record

CONFIDENCE = 0.95
UNSHARD_CFGS = [("large", 1.0), ("large", 64.0), ("small", 1.0), ("uneven", 1.0), ("uneven", 32.0)]


# ------------------------------------------------------------------------------ the interval
def test_median_interval_needs_six_values_for_95_percent():
    # [min, max] of n values misses the median with probability 2 / 2**n: above 5% for n <= 5
    assert report.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert report.median_ci([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)


@pytest.mark.parametrize("n", [6, 11, 16, 40, 150])
def test_median_interval_covers_at_least_the_stated_level_but_is_not_trivial(n):
    """Over many draws of a skewed distribution with a known median, the interval covers that
    median at least 95% of the time (within simulation error) and, once ``[min, max]`` is no
    longer needed, less than always."""
    rng = np.random.default_rng(n)
    true_median = 1.0  # lognormal(0, s): median exp(0)
    trials, covered, widths_below_range = 3000, 0, 0
    for _ in range(trials):
        xs = rng.lognormal(0.0, 0.4, size=n)
        lo, hi = report.median_ci(list(xs))
        covered += lo <= true_median <= hi
        widths_below_range += (hi - lo) < (xs.max() - xs.min())
    coverage = covered / trials
    se = math.sqrt(0.95 * 0.05 / trials)
    assert coverage >= 0.95 - 3 * se, f"n={n}: coverage {coverage:.3f} below 95%"
    if n >= 9:  # the interval is narrower than the range, so it cannot cover every time
        assert widths_below_range == trials
        assert coverage < 0.999, f"n={n}: coverage {coverage:.4f}: interval far too wide"


# ------------------------------------------------------------------------------ the verdict
def _records(ratios_per_case, *, ws=1, path="unshard", rng_seed=0):
    """Paired records as the suite makes them: upstream's per-round times carry a shared load
    factor (heavy-tailed), the implementation's are upstream's times the given ratios."""
    rng = np.random.default_rng(rng_seed)
    perf = SimpleNamespace(
        impls={"ref": SimpleNamespace(version="test")},
        placement={ws: ("cpu", "gloo")},
        config=SimpleNamespace(option=SimpleNamespace(threads_per_rank=1)),
        quick=False,
    )
    records = []
    for (shape_set, size), ratios in zip(UNSHARD_CFGS, ratios_per_case):
        upstream = 0.010 * rng.lognormal(0.0, 0.5, size=len(ratios))  # load varies per round
        mine = upstream * np.asarray(ratios)
        case = Case("paired", ws, "reference", "ref", "fsdp2", shape_set, size, path,
                    f"{path}_upstream")  # fmt: skip
        result = TaskResult(times={path: list(mine), f"{path}_upstream": list(upstream)})
        records.append(make_record(case, result, perf))
    return records


def _sign_test_slower(ratios, cases: int) -> bool:
    """One-sided sign test of "median ratio <= 1" at level (1 - 95%) / (2 * cases): too few
    rounds at or below 1.00 for a fair coin (Bonferroni over the target's cases)."""
    n, at_or_below = len(ratios), sum(r <= 1.0 for r in ratios)
    p_value = sum(math.comb(n, j) for j in range(at_or_below + 1)) / 2**n
    return p_value <= (1 - CONFIDENCE) / (2 * cases)


def _expected(ratio_sets) -> str:
    return "not met" if any(_sign_test_slower(r, len(ratio_sets)) for r in ratio_sets) else "met"


def _verdict(records) -> str:
    text = report.render(records, {})
    found = re.search(r"unshard\+reshard ≤ 1\.00× torch-fsdp2 \(paired rounds\), ws 1: \*\*(.+?)\*\*",
                      text)  # fmt: skip
    assert found, text
    return found.group(1)


def _noisy(rng, centre, rounds, cases, noise=0.05):
    return [list(centre[c] * (1 + noise * rng.standard_normal(rounds))) for c in range(cases)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clearly_slower_is_not_met_and_parity_is_met(seed):
    rng = np.random.default_rng(100 + seed)
    cases, rounds = len(UNSHARD_CFGS), 20
    slower = _noisy(rng, [1.2] * cases, rounds, cases)
    parity = _noisy(rng, [1.0] * cases, rounds, cases)
    # what the data says (sign test); at 1.2x with 5% noise no round comes near 1.00
    assert _expected(slower) == "not met"
    assert _verdict(_records(slower, rng_seed=seed)) == "not met"
    assert _verdict(_records(parity, rng_seed=seed)) == _expected(parity)


def test_parity_is_met_whatever_the_load():
    """At parity the round ratios straddle 1.00, so no case is significantly slower: met, even
    though the per-round times themselves vary several-fold with the load."""
    rng = np.random.default_rng(7)
    cases = len(UNSHARD_CFGS)
    parity = _noisy(rng, [1.0] * cases, 30, cases)
    expected = _expected(parity)
    assert expected == "met", "the generated parity data is not at parity by the sign test"
    assert _verdict(_records(parity)) == expected


def test_one_slower_case_among_parity_is_named():
    rng = np.random.default_rng(11)
    cases = len(UNSHARD_CFGS)
    centre = [1.0] * cases
    centre[3] = 1.25
    ratio_sets = _noisy(rng, centre, 24, cases)
    slow = [i for i, r in enumerate(ratio_sets) if _sign_test_slower(r, cases)]
    assert slow == [3]
    text = report.render(_records(ratio_sets), {})
    line = next(ln for ln in text.splitlines() if "unshard+reshard ≤ 1.00×" in ln)
    assert "**not met**" in line
    assert f"significantly slower on ws1 {report._cfg_name(UNSHARD_CFGS[3])}" in line


def test_too_few_rounds_is_not_judged_and_the_table_shows_rounds_and_intervals():
    rng = np.random.default_rng(3)
    cases = len(UNSHARD_CFGS)
    ratio_sets = _noisy(rng, [1.0] * cases, 16, cases)
    ratio_sets[0] = ratio_sets[0][:4]  # four rounds: no 95% interval exists
    records = _records(ratio_sets)
    assert _verdict(records) == "not judged"
    text = report.render(records, {})
    for rec, ratios in zip(records, ratio_sets):
        assert rec["rounds"] == len(ratios)
        lo_hi = report.median_ci(rec["round_ratios"])
        row = next(ln for ln in text.splitlines()
                   if ln.startswith("| 1 |") and report._cfg_name(report._cfg(rec)) in ln)  # fmt: skip
        assert f"| {statistics.median(ratios):.2f}× |" in row
        assert f"| {len(ratios)} |" in row
        if lo_hi is not None:
            assert f"[{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" in row


def test_round_ratios_pair_each_round_with_the_same_rounds_floor():
    ratios = [1.0, 2.0, 0.5, 1.5, 1.0, 3.0]
    (rec,) = _records([ratios])
    assert rec["round_ratios"] == pytest.approx(ratios)


def test_the_intervals_are_joint_over_the_targets_cases():
    """A case with 3 of 16 rounds at or below 1.00 would be significantly slower on its own (a
    one-sided sign test gives p = 697 / 65536 ≈ 0.011 < 0.025) but not once the level is shared
    by the target's five cases (0.011 > 0.005): the target is met."""
    cases = len(UNSHARD_CFGS)
    borderline = [0.97, 0.98, 0.99] + [1.01 + 0.01 * i for i in range(13)]
    parity = [1.0 + 0.01 * ((-1) ** i) * (i % 7) for i in range(16)]
    ratio_sets = [borderline] + [parity] * (cases - 1)
    assert _sign_test_slower(borderline, 1) and not _sign_test_slower(borderline, cases)
    assert _expected(ratio_sets) == "met"
    assert _verdict(_records(ratio_sets)) == "met"
