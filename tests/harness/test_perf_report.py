"""The perf report's paired statistics: the median's interval and the "≤ 1.00× upstream" verdict.

Synthetic per-round times, in blocks as the paired body measures them (both models rebuilt before
each block), go through the suite's own record builder (``perf.conftest.make_record``, which
derives the per-round ratios and the block medians) and the report (``perf.report.render``). Every
expected verdict is derived from the generated data by a one-sided sign test on the block medians
written here (the dual of an order-statistics interval), never read off the report.
"""

from __future__ import annotations

import math
import re
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from perf import report
from perf._bodies import paired
from perf.conftest import FULL_SIZES, STATE_DICT_SMALL_MAX_MB, Case, TaskResult, make_record

CONFIDENCE = 0.95
UNSHARD_CFGS = [
    ("large", 1.0), ("large", 8.0), ("large", 64.0), ("small", 1.0), ("uneven", 1.0),
    ("uneven", 32.0),
]  # fmt: skip


# ------------------------------------------------------------------------------ the interval
def test_median_interval_needs_six_values_for_95_percent():
    # [min, max] of n values misses the median with probability 2 / 2**n: above 5% for n <= 5
    assert report.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert report.median_ci([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)


@pytest.mark.parametrize("n", [6, 9, 11, 16, 40])
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


@pytest.mark.parametrize("cases", [1, 6, 12])
def test_min_blocks_is_the_fewest_with_a_joint_interval(cases):
    """[min, max] of n values misses the median with probability 2 / 2**n; at the joint level
    each case may miss with (1 - 95%) / cases: 6 blocks for one case, 8 for 6, 9 for 12."""
    level = 1 - (1 - CONFIDENCE) / cases
    n = report.min_blocks(cases)
    assert 2 / 2**n <= (1 - CONFIDENCE) / cases < 2 / 2 ** (n - 1)
    assert report.median_ci(list(range(n)), level) == (0, n - 1)
    assert report.median_ci(list(range(n - 1)), level) is None


def test_the_paired_body_runs_enough_blocks_for_its_largest_target():
    """The FULL state-dict target spans world sizes 2 and 4 over every paired shape
    configuration (the many-small set only up to the state-dict cap)."""
    configs = sum(
        1
        for shape_set, sizes in FULL_SIZES.items()
        for size in sizes
        if not (shape_set == "small" and size > STATE_DICT_SMALL_MAX_MB)
    )
    largest = max(len(ws) for _, ws in report.PAIRED_TARGETS) * configs
    assert report.min_blocks(largest) <= paired.BLOCKS


# ------------------------------------------------------------------------------ the verdict
def _records(blocks_per_case, *, ws=1, path="unshard", rng_seed=0):
    """Paired records as the suite makes them: per case a list of blocks, each a list of
    per-round ratios; upstream's per-round times carry a shared load factor (heavy-tailed), the
    implementation's are upstream's times the given ratios."""
    rng = np.random.default_rng(rng_seed)
    perf = SimpleNamespace(
        impls={"ref": SimpleNamespace(version="test")},
        placement={ws: ("cpu", "gloo")},
        config=SimpleNamespace(option=SimpleNamespace(threads_per_rank=1)),
        quick=False,
    )
    records = []
    for (shape_set, size), blocks in zip(UNSHARD_CFGS, blocks_per_case):
        ratios = [r for b in blocks for r in b]
        upstream = 0.010 * rng.lognormal(0.0, 0.5, size=len(ratios))  # load varies per round
        mine = upstream * np.asarray(ratios)
        case = Case("paired", ws, "reference", "ref", "fsdp2", shape_set, size, path,
                    f"{path}_upstream")  # fmt: skip
        result = TaskResult(
            times={path: list(mine), f"{path}_upstream": list(upstream)},
            info={"round_blocks": {path: [len(b) for b in blocks]}},
        )
        records.append(make_record(case, result, perf))
    return records


def _sign_test_slower(values, cases: int) -> bool:
    """One-sided sign test of "median <= 1" at level (1 - 95%) / (2 * cases): too few values at
    or below 1.00 for a fair coin (Bonferroni over the target's cases)."""
    n, at_or_below = len(values), sum(v <= 1.0 for v in values)
    p_value = sum(math.comb(n, j) for j in range(at_or_below + 1)) / 2**n
    return p_value <= (1 - CONFIDENCE) / (2 * cases)


def _block_medians(blocks) -> list[float]:
    return [statistics.median(b) for b in blocks]


def _expected(block_sets) -> str:
    cases = len(block_sets)
    slower = any(_sign_test_slower(_block_medians(b), cases) for b in block_sets)
    return "not met" if slower else "met"


def _verdict(records) -> str:
    text = report.render(records, {})
    found = re.search(r"unshard\+reshard ≤ 1\.00× torch-fsdp2 \(paired rounds\), ws 1: \*\*(.+?)\*\*",
                      text)  # fmt: skip
    assert found, text
    return found.group(1)


def _blocked(rng, centres, blocks=paired.BLOCKS, rounds=12, between=0.03, within=0.002):
    """Per case: ``blocks`` blocks of ``rounds`` ratios; each block's level is the case's centre
    times a factor uniform in ±``between`` (the placement draw), each round that times a
    ``within`` noise."""
    out = []
    for centre in centres:
        levels = centre * (1 + rng.uniform(-between, between, size=blocks))
        out.append([list(lv * (1 + within * rng.standard_normal(rounds))) for lv in levels])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_variation_around_parity_is_met_and_a_clear_slowdown_is_not(seed):
    """Within-block noise tiny, block levels ±3% around 1.00: every block's rounds agree with
    each other, so an interval over rounds would be narrow and could land wholly above 1.00;
    over blocks it straddles parity. A 1.2× slowdown lies above 1.00 in every block."""
    rng = np.random.default_rng(100 + seed)
    cases = len(UNSHARD_CFGS)
    parity = _blocked(rng, [1.0] * cases)
    slower = _blocked(rng, [1.2] * cases)
    assert _expected(parity) == "met"
    assert _expected(slower) == "not met"
    assert _verdict(_records(parity, rng_seed=seed)) == "met"
    assert _verdict(_records(slower, rng_seed=seed)) == "not met"


def test_the_verdict_counts_blocks_not_rounds():
    """Six blocks of nine at 1.03 and three at 0.97, 20 quiet rounds each: on rounds alone
    (120 of 180 above 1.00) a sign test calls the case slower; on blocks (3 of 9 at or below
    1.00) it does not, and blocks are the independent draws: met."""
    rng = np.random.default_rng(5)
    cases = len(UNSHARD_CFGS)
    levels = [1.03] * 6 + [0.97] * 3
    lopsided = [list(lv * (1 + 0.002 * rng.standard_normal(20))) for lv in levels]
    block_sets = [lopsided] + _blocked(rng, [1.0] * (cases - 1))
    rounds = [r for b in lopsided for r in b]
    assert _sign_test_slower(rounds, cases)  # what an interval over rounds would say
    assert _expected(block_sets) == "met"
    assert _verdict(_records(block_sets)) == "met"


def test_one_slower_case_among_parity_is_named():
    rng = np.random.default_rng(11)
    cases = len(UNSHARD_CFGS)
    centre = [1.0] * cases
    centre[3] = 1.25
    block_sets = _blocked(rng, centre, within=0.05)
    slow = [i for i, b in enumerate(block_sets) if _sign_test_slower(_block_medians(b), cases)]
    assert slow == [3]
    text = report.render(_records(block_sets), {})
    line = next(ln for ln in text.splitlines() if "unshard+reshard ≤ 1.00×" in ln)
    assert "**not met**" in line
    assert f"significantly slower on ws1 {report._cfg_name(UNSHARD_CFGS[3])}" in line


def test_too_few_blocks_is_not_judged_and_the_table_shows_blocks_and_intervals():
    rng = np.random.default_rng(3)
    cases = len(UNSHARD_CFGS)
    block_sets = _blocked(rng, [1.0] * cases, within=0.05)
    block_sets[0] = block_sets[0][: report.min_blocks(cases) - 1]  # one block short
    records = _records(block_sets)
    assert _verdict(records) == "not judged"
    text = report.render(records, {})
    for rec, blocks in zip(records, block_sets):
        medians = _block_medians(blocks)
        rounds = sum(len(b) for b in blocks)
        assert rec["rounds"] == rounds
        assert rec["block_ratios"] == pytest.approx(medians)
        lo_hi = report.median_ci(medians)  # the table's interval: 95% for the case alone
        row = next(ln for ln in text.splitlines()
                   if ln.startswith("| 1 |") and report._cfg_name(report._cfg(rec)) in ln)  # fmt: skip
        assert f"| {statistics.median(medians):.2f}× |" in row
        assert f"| {len(blocks)} × {rounds} |" in row
        if lo_hi is not None:
            assert f"[{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" in row


def test_a_record_without_blocks_is_not_judged():
    """Records made before blocks (rounds on one allocation) carry no block medians: their
    rounds say nothing about the placement, so the target is not judged on them."""
    rng = np.random.default_rng(4)
    records = _records(_blocked(rng, [1.0] * len(UNSHARD_CFGS)))
    for rec in records:
        del rec["block_ratios"], rec["round_blocks"]
    assert _verdict(records) == "not judged"


def test_ratios_pair_each_round_with_the_same_rounds_floor_and_blocks_take_medians():
    blocks = [[1.0, 2.0, 0.5], [1.5, 1.0, 3.0, 0.9]]
    (rec,) = _records([blocks])
    assert rec["round_ratios"] == pytest.approx([r for b in blocks for r in b])
    assert rec["round_blocks"] == [3, 4]
    assert rec["block_ratios"] == pytest.approx([1.0, 1.25])


def test_the_intervals_are_joint_over_the_targets_cases():
    """A case with 1 of 9 blocks at or below 1.00 would be significantly slower on its own (a
    one-sided sign test gives p = 10 / 512 ≈ 0.020 < 0.025) but not once the level is shared by
    the target's six cases (0.020 > 0.025 / 6): the target is met."""
    rng = np.random.default_rng(8)
    cases = len(UNSHARD_CFGS)
    levels = [0.99] + [1.01 + 0.01 * i for i in range(paired.BLOCKS - 1)]
    borderline = [list(lv * (1 + 0.001 * rng.standard_normal(10))) for lv in levels]
    block_sets = [borderline] + _blocked(rng, [1.0] * (cases - 1))
    medians = _block_medians(borderline)
    assert _sign_test_slower(medians, 1) and not _sign_test_slower(medians, cases)
    assert _expected(block_sets) == "met"
    assert _verdict(_records(block_sets)) == "met"
