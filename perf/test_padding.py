"""Padding path: sharding with padding at construction and re-padding after a load with
``assign=True`` / ``reset_sharded_param``, next to a memcpy of the same bytes. See
``perf/_bodies/padding.py``."""

import pytest

from perf import _clock

AREA = "padding"
pytestmark = pytest.mark.benchmark(timer=_clock.virtual_clock)


def test_padding(perf, benchmark, case):
    perf.run_case(benchmark, case)
