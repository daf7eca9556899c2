"""Running checks when the harness itself was launched by ``torchrun`` (the multi-node path).

Every rank runs the same pytest session, collects the same cases in the same order and runs each
check in-process; the ranks' results are exchanged with ``all_gather_object`` so that every rank
knows the case's outcome, and rank 0 writes the reports. There is no driver above the ranks here,
so a hung check cannot be recovered: a watchdog dumps this rank's stacks to the terminal and ends
the process ``grace`` seconds after the check's timeout, and torchrun then tears the job down. The
stacks go to the stderr the process started with (``terminal_fd``, a duplicate the plugin takes at
import, before pytest's output capture replaces fd 2), so no capture mode can swallow them. After
each check the process groups it created are released, as in a worker rank.
"""

from __future__ import annotations

import faulthandler
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from conformance.runner.execute import execute
from conformance.runner.protocol import RankResult, Task
from conformance.runner.resources import LEDGER


class InProcessGroup:
    def __init__(self, device: str, backend: str, *, grace: float = 5.0, terminal_fd: int = 2):
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.device = torch.device(device)
        if self.device.type != "cpu":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.get_device_module(self.device.type).set_device(local)
            self.device = torch.device(self.device.type, local)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        self.backend = backend
        # results travel on a CPU group so that any device backend works
        self._objects = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.spawn_count = 0
        self.grace = grace
        self.terminal_fd = terminal_fd
        gc.freeze()  # see conformance.runner.worker: makes the release after each check cheap

    def start(self) -> None:
        pass  # the process group was joined in __init__

    def run(self, task: Task) -> list[RankResult]:
        faulthandler.dump_traceback_later(
            task.timeout + self.grace, exit=True, file=self.terminal_fd
        )
        LEDGER.begin()
        try:
            mine = execute(task, self.rank, self.world_size, self.device, self.backend)
        finally:
            faulthandler.cancel_dump_traceback_later()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self._objects)
        # Every rank is past the check now: release what it created (see
        # [Note: per-check cleanup] in conformance.runner.resources).
        LEDGER.release()
        return gathered

    def close(self) -> None:
        pass  # torchrun owns the processes; the group lives until the interpreter exits
