"""All-gather path: copy-in, unshard (copy-in + collective), copy-out and end-to-end
unshard+reshard of one parameter group, next to the raw single-tensor all-gather of the same padded
bytes (``floor``) and a per-parameter ``all_gather`` + ``cat`` (``naive``). See
``perf/_bodies/allgather.py``."""

import pytest

from perf import _clock

AREA = "allgather"
pytestmark = pytest.mark.benchmark(timer=_clock.virtual_clock)


def test_allgather(perf, benchmark, case):
    perf.run_case(benchmark, case)
