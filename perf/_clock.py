"""A virtual clock that lets pytest-benchmark record durations measured inside the ranks.

pytest-benchmark times ``target()`` as ``timer()`` after minus ``timer()`` before. The perf suite
marks every benchmark with ``@pytest.mark.benchmark(timer=virtual_clock)`` and calls
``benchmark.pedantic(advance, rounds=len(times))`` after :func:`feed` queued the slowest-rank round
times: each round, ``advance`` moves the clock forward by the next measured time, so
``benchmark.stats`` holds exactly those times (``tests`` of this file: ``perf/test_clock.py``).
"""

from __future__ import annotations

_now = 0.0
_queue: list[float] = []


def virtual_clock() -> float:
    return _now


def feed(times) -> None:
    _queue[:] = [float(t) for t in times]


def advance() -> None:
    global _now
    if not _queue:
        raise RuntimeError("virtual clock: no measured round left (feed() the times first)")
    _now += _queue.pop(0)
