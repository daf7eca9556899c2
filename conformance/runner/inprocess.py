"""Running checks when the harness itself was launched by ``torchrun`` or ``srun`` (the multi-node
path; see docs/multi-node.md).

Every rank runs the same pytest session, collects the same cases in the same order and runs each
check in-process. There is no driver above the ranks here, so a hung check cannot be recovered: a
watchdog dumps this rank's stacks to the terminal and ends the process ``grace`` seconds after the
check's budget. The stacks go to the stderr the process started with (``terminal_fd``, a duplicate
the plugin takes at import, before pytest's output capture replaces fd 2), so no capture mode can
swallow them. After each check the process groups it created are released, as in a worker rank.

[Note: results through the store]
After a check each rank posts its result to the job's key-value store (the one the default process
group was set up with: hosted on rank 0's node under torchrun and in rank 0's own process under
srun) and waits for every other rank's. No collective is involved, so a rank that is gone cannot
make the wait hang or fail: the wait has a deadline, the latest moment a live rank can still post
(the check's budget + ``grace``, when its watchdog ends it, + ``LOSS_MARGIN``). A rank whose
result is not there by then is *lost*: its process died (killed, out of memory, ended by its
watchdog) or its node went away. Its case fails with ``died`` on that rank, every surviving rank
sets :attr:`InProcessGroup.lost` and the plugin stops the run: rank 0 writes the partial reports
and the command exits with ``EXIT_RANKS_LOST`` (the default process group is broken by then; no
later check could run). Each rank deletes its previous result once every rank has moved past it.

[Note: the end barrier]
torchrun's agent stops every process of its node as soon as one of them exits non-zero, so a rank
that finished its session (with failures: exit code 1) could have rank 0 killed on the same node
while it is still writing the reports. At interpreter exit every other rank therefore waits for
rank 0's "reports written" key (``END_WAIT`` seconds at most) and, on rank 0's node, for its
process to end (``END_EXIT_WAIT``), so that rank 0's exit code is the one torchrun reports.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from conformance import devices, options
from conformance.runner.execute import execute
from conformance.runner.protocol import DIED, RankResult, Task
from conformance.runner.resources import LEDGER

LOSS_MARGIN = 5.0  # seconds past a rank's last possible moment before it counts as lost
END_WAIT = 300.0  # seconds the other ranks wait at exit for rank 0's reports
END_EXIT_WAIT = 10.0  # seconds the ranks on rank 0's node then wait for its process to end
_KEYS = "fsdp-conformance/"


def launched_sizes(text: str | None, device: str | None, backend: str | None):
    """``(world_sizes, placement)`` of a run launched by torchrun / srun: the one world size is
    ``$WORLD_SIZE``, and ``--world-sizes``, when given, must say the same. The automatic device
    choice counts this node's ranks (``$LOCAL_WORLD_SIZE``), not the job's. Raises
    :class:`~conformance.options.UsageError`."""
    try:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise options.UsageError(
            "$WORLD_SIZE",
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} / LOCAL_WORLD_SIZE="
            f"{os.environ.get('LOCAL_WORLD_SIZE')!r} is not a number of ranks",
            "launch with torchrun, or set them as docs/multi-node.md shows for srun",
        ) from None
    asked = options.world_sizes(text)
    if asked is not None and asked != [world]:
        raise options.UsageError(
            "--world-sizes",
            f"{','.join(map(str, asked))} asked for, but this job has WORLD_SIZE={world} ranks "
            "(torchrun: --nnodes x --nproc-per-node; srun: --ntasks); a launched run checks "
            "exactly that world size",
            f"pass --world-sizes {world} or drop it, or launch {asked[0]} ranks",
        )
    if device not in (None, "cpu"):
        count = devices.accelerator_count(device)
        if local > count:
            raise options.UsageError(
                "--device",
                f"{local} ranks on this node (LOCAL_WORLD_SIZE) need {local} {device} devices, "
                f"{count} available here",
                f"launch at most {count} ranks per node (--nproc-per-node / --ntasks-per-node), "
                "or pass --device cpu",
            )
    return [world], {world: devices.choose(local, device, backend)}


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
        self._store = dist.PrefixStore(_KEYS, dist.distributed_c10d._get_default_store())
        node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID"))
        where = socket.gethostname() if node is None else f"node {node}, {socket.gethostname()}"
        self._store.set(f"where/{self.rank}", where)
        self._node = (node, socket.gethostname())
        if self.rank == 0:
            self._store.set("reporter", pickle.dumps((self._node, os.getpid())))
        self._seq = 0
        self._waited = ""  # how long the last check's results were waited for, and why
        self.lost: list[int] = []  # ranks lost in the last check; the run stops (see the Note)
        self.lost_text = ""  # "lost ranks 2, 3 (node 1, host-b)" for the reports
        self.spawn_count = 0
        self.grace = grace
        self.terminal_fd = terminal_fd
        atexit.register(self._end_barrier)
        gc.freeze()  # see conformance.runner.worker: makes the release after each check cheap

    def start(self) -> None:
        pass  # the process group was joined in __init__

    def run(self, task: Task) -> list[RankResult]:
        self._seq += 1
        wait = task.timeout + self.grace + LOSS_MARGIN
        deadline = time.monotonic() + wait
        budget = task.timeout_text or f"{task.timeout:g} s"
        self._waited = (
            f"{wait:g} s: its budget {budget} + --grace {self.grace:g} s + {LOSS_MARGIN:g} s"
        )
        faulthandler.dump_traceback_later(
            task.timeout + self.grace, exit=True, file=self.terminal_fd
        )
        LEDGER.begin()
        try:
            mine = execute(task, self.rank, self.world_size, self.device, self.backend)
        finally:
            faulthandler.cancel_dump_traceback_later()
        results = self._exchange(mine, deadline)
        if self.lost:
            self._say_lost(task)
            return results
        # Every rank is past the check now: release what it created (see
        # [Note: per-check cleanup] in conformance.runner.resources).
        LEDGER.release()
        return results

    def _key(self, rank: int, seq: int | None = None) -> str:
        return f"result/{self._seq if seq is None else seq}/{rank}"

    def _exchange(self, mine: RankResult, deadline: float) -> list[RankResult]:
        """Every rank's result of this check, through the store (see [Note: results through the
        store]); a rank missing at ``deadline`` gets a ``died`` result and lands in ``lost``."""
        self._store.set(self._key(self.rank), pickle.dumps(mine))
        keys = [self._key(r) for r in range(self.world_size)]
        try:  # one blocking wait: under torchrun a signal ends this process at once anyway
            self._store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        except dist.DistStoreError:  # the deadline passed with some result missing
            pass
        present = [r for r in range(self.world_size) if self._store.check([self._key(r)])]
        self.lost = sorted(set(range(self.world_size)) - set(present))
        results = [self._result(r) for r in range(self.world_size)]
        if not self.lost and self._seq > 1:  # every rank has read the previous results
            self._store.delete_key(self._key(self.rank, self._seq - 1))
        return results

    def _result(self, rank: int) -> RankResult:
        if rank not in self.lost:
            return pickle.loads(self._store.get(self._key(rank)))
        return RankResult(rank, DIED, None, self._lost_detail(rank), 0.0)

    def _where(self, rank: int) -> str:
        key = f"where/{rank}"
        return self._store.get(key).decode() if self._store.check([key]) else "unknown node"

    def _lost_detail(self, rank: int) -> str:
        return (
            f"lost: rank {rank} ({self._where(rank)}) posted no result by the latest moment a "
            f"live rank can ({self._waited} after the check started): its process ended "
            "(killed, out of memory, or by its watchdog after a hang: its stacks are on its own "
            "stderr) or its node went away. The run stops here; see docs/multi-node.md"
        )

    def _say_lost(self, task: Task) -> None:
        nodes = sorted({self._where(r) for r in self.lost})
        ranks = ", ".join(map(str, self.lost))
        self.lost_text = (
            f"lost rank{'s' if len(self.lost) > 1 else ''} {ranks} ({'; '.join(nodes)})"
        )
        rest = (
            "rank 0 writes the partial reports"
            if 0 not in self.lost
            else "rank 0 is among them: no reports are written"
        )
        os.write(
            self.terminal_fd,
            f"fsdp conformance: rank {self.rank}: {self.lost_text} during {task.fn} (no result "
            f"{self._waited} after the check started); the run stops, {rest}\n".encode(),
        )

    def _end_barrier(self) -> None:
        """See [Note: the end barrier]."""
        try:
            if self.rank == 0:
                self._store.set("reports-written", "1")
                return
            if 0 in self.lost:
                return
            self._store.wait(["reports-written"], timedelta(seconds=END_WAIT))
            node, pid = pickle.loads(self._store.get("reporter"))
        except (dist.DistError, RuntimeError):  # rank 0 or the store is gone: nothing to wait for
            return
        if node != self._node:
            return
        end = time.monotonic() + END_EXIT_WAIT  # on rank 0's node: let it exit first
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except OSError:
                return
            time.sleep(0.05)

    def close(self) -> None:
        pass  # torchrun owns the processes; the group lives until the interpreter exits
