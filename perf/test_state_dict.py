"""State-dict paths (FSDP1 FULL/SHARDED/LOCAL, FSDP2 DTensor and the DCP helpers), save and load,
next to the raw gather of the same bytes for FULL kinds. See ``perf/_bodies/state_dict.py``."""

import pytest

from perf import _clock

AREA = "state_dict"
pytestmark = pytest.mark.benchmark(timer=_clock.virtual_clock)


def test_state_dict(perf, benchmark, case):
    perf.run_case(benchmark, case)
