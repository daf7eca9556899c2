"""Multi-rank execution of checks.

* :class:`~conformance.runner.pool.WorkerGroup` — worker processes for one (world size, device, backend),
  spawned once and reused for many checks, with timeouts, stack capture and restart.
* :class:`~conformance.runner.inprocess.InProcessGroup` — the same interface when the harness itself runs
  under ``torchrun`` (each rank runs the check in-process; results are gathered to every rank).
"""

from conformance.runner.protocol import RankResult, Task

__all__ = ["RankResult", "Task"]
