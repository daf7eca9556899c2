"""The virtual clock hands pytest-benchmark exactly the times measured in the ranks."""

import statistics

import pytest

from perf import _clock

pytestmark = pytest.mark.benchmark(timer=_clock.virtual_clock, group="self-test")


def test_virtual_clock_feeds_benchmark_stats(benchmark):
    times = [0.25, 0.5, 0.125, 1.0, 0.75]
    _clock.feed(times)
    benchmark.pedantic(_clock.advance, rounds=len(times), iterations=1)
    if benchmark.disabled:  # quick mode: pedantic ran the target once and kept no stats
        assert _clock._queue == times[1:]
        return
    stats = benchmark.stats.stats
    assert stats.rounds == len(times)
    assert stats.median == pytest.approx(statistics.median(times))
    assert stats.min == pytest.approx(min(times)) and stats.max == pytest.approx(max(times))
    assert sorted(stats.data) == pytest.approx(sorted(times))
