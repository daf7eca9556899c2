"""Paired with upstream: the implementation's unshard+reshard and FULL state dict next to upstream
torch FSDP2's in the same task, rounds interleaved (``×floor`` = implementation / upstream). See
``perf/_bodies/paired.py``."""

import pytest

from perf import _clock

AREA = "paired"
pytestmark = pytest.mark.benchmark(timer=_clock.virtual_clock)


def test_paired(perf, benchmark, case):
    perf.run_case(benchmark, case)
