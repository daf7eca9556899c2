"""Running checks when the harness itself was launched by ``torchrun`` or ``srun`` (the multi-node
path; see docs/multi-node.md).

Every rank runs the same pytest session, collects the same cases in the same order and runs each
check in-process. There is no driver above the ranks here, so a hung check cannot be recovered:
``grace`` seconds after the check's budget a watchdog thread dumps this rank's stacks to the
terminal and stops the run ([Note: a stuck rank], :meth:`InProcessGroup._stuck`); a C-level
watchdog ends the process ``STUCK_EXTRA`` seconds later should even that thread not run. The
stacks go to the stderr the process started with (``terminal_fd``, a duplicate the plugin takes at
import, before pytest's output capture replaces fd 2), so no capture mode can swallow them. After
each check the process groups it created are released, as in a worker rank.

[Note: results through the store]
After a check each rank posts its result to the job's key-value store (the one the default process
group was set up with: hosted on rank 0's node under torchrun and in rank 0's own process under
srun) and waits for every other rank's. No collective is involved, so a rank that is gone cannot
make the wait hang or fail: the wait has a deadline, the latest moment a live rank can still post
(the check's budget + ``grace``, when its watchdog ends it, + ``LOSS_MARGIN``). A rank whose
result is not there by then is *lost*: its process died (killed, out of memory, ended by its
watchdog) or its node went away; a rank still in the check then has posted its stack instead
("stuck"). Its case fails with ``died`` / ``timeout`` on those ranks, every other rank sets
:attr:`InProcessGroup.stop_reason` and the plugin stops the run: rank 0 writes the partial reports
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
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from conformance import devices, options
from conformance.runner.execute import execute
from conformance.runner.protocol import DIED, TIMEOUT, RankResult, Task
from conformance.runner.resources import LEDGER

LOSS_MARGIN = 5.0  # seconds past a rank's last possible moment before it counts as lost
STUCK_EXTRA = LOSS_MARGIN + 60.0  # seconds a stuck rank's thread gets for its reports
EXIT_RANKS_LOST = 6  # = conformance.plugin.EXIT_RANKS_LOST
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
    def __init__(
        self, device: str, backend: str, *, grace: float = 5.0, terminal_fd: int = 2, session=None
    ):
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
        self.session = session  # the plugin's ConformanceSession: rank 0's reports
        self._seq = 0
        self._waited = ""  # how long the last check's results were waited for, and why
        self._lock = threading.Lock()
        self._claimed = False  # the watchdog thread took over (see [Note: a stuck rank])
        self._finished = threading.Event()
        self.lost: list[int] = []  # ranks with no result in the last check (see the Notes)
        self.stuck: list[int] = []  # ranks still in the last check past its budget + grace
        self.stop_reason = ""  # "lost ranks 2, 3 (node 1, host-b)": the run stops
        self.lost_text = ""
        self.spawn_count = 0
        self.grace = grace
        self.terminal_fd = terminal_fd
        atexit.register(self._end_barrier)
        gc.freeze()  # see conformance.runner.worker: makes the release after each check cheap

    def start(self) -> None:
        pass  # the process group was joined in __init__

    def run(self, task: Task, settled=None) -> list[RankResult]:  # settled: unused here
        self._seq += 1
        budget = task.timeout + self.grace  # when this rank's watchdog fires
        wait = budget + LOSS_MARGIN
        deadline = time.monotonic() + wait
        text = task.timeout_text or f"{task.timeout:g} s"
        self._waited = (
            f"{wait:g} s: its budget {text} + --grace {self.grace:g} s + {LOSS_MARGIN:g} s"
        )
        # A stuck rank reports from a thread (see [Note: a stuck rank]); if even that cannot run,
        # the C-level watchdog ends the process with its stacks.
        self._finished = threading.Event()
        watchdog = threading.Timer(budget, self._stuck, args=(self._seq, task, self._finished))
        watchdog.daemon = True
        faulthandler.dump_traceback_later(budget + STUCK_EXTRA, exit=True, file=self.terminal_fd)
        watchdog.start()
        LEDGER.begin()
        try:
            mine = execute(task, self.rank, self.world_size, self.device, self.backend)
        finally:
            watchdog.cancel()
            with self._lock:
                claimed = self._claimed
                self._finished.set()
            if claimed:  # too late: the watchdog thread reports and ends this process
                threading.Event().wait()
            faulthandler.cancel_dump_traceback_later()
        self._store.set(self._key("result", self.rank), pickle.dumps(mine))
        keys = [self._key("result", r) for r in range(self.world_size)]
        try:  # one blocking wait: under torchrun a signal ends this process at once anyway
            self._store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        except dist.DistStoreError:  # the deadline passed with some result missing
            pass
        results = self._collect(self._seq)
        if self.stop_reason:
            self._say(task)
            return results
        if self._seq > 1:  # every rank has read the previous results
            self._store.delete_key(self._key("result", self.rank, self._seq - 1))
        # Every rank is past the check now: release what it created (see
        # [Note: per-check cleanup] in conformance.runner.resources).
        LEDGER.release()
        return results

    def _key(self, kind: str, rank: int, seq: int | None = None) -> str:
        return f"{kind}/{self._seq if seq is None else seq}/{rank}"

    def _collect(self, seq: int) -> list[RankResult]:
        """Each rank's result of check ``seq``: the one it posted, its stuck report, or ``died``
        (see [Note: results through the store]); sets ``lost``, ``stuck`` and ``stop_reason``."""
        results, self.lost, self.stuck = [], [], []
        for r in range(self.world_size):
            for kind, into in (("result", None), ("stuck", self.stuck)):
                key = self._key(kind, r, seq)
                if self._store.check([key]):
                    results.append(pickle.loads(self._store.get(key)))
                    if into is not None:
                        into.append(r)
                    break
            else:
                self.lost.append(r)
                results.append(RankResult(r, DIED, None, self._lost_detail(r), 0.0))
        parts = []
        if self.lost:
            nodes = "; ".join(sorted({self._where(r) for r in self.lost}))
            parts.append(f"lost {_ranks(self.lost)} ({nodes})")
        if self.stuck:
            parts.append(f"{_ranks(self.stuck)} stuck in the check past its budget + --grace")
        self.stop_reason = "; ".join(parts)
        self.lost_text = self.stop_reason  # the name of earlier versions
        return results

    def _stuck(self, seq: int, task: Task, finished: threading.Event) -> None:
        """[Note: a stuck rank] The check is still running on this rank at its budget + grace
        (waiting in a collective for a rank that is gone, or hung). This thread posts the rank's
        stack as its result, waits ``LOSS_MARGIN`` for every other rank to post a result or a
        stuck report, and then ends the run from here: rank 0 writes the partial reports (the
        case fails with each rank's state), every other rank waits for them; exit code
        ``EXIT_RANKS_LOST``."""
        with self._lock:
            if finished.is_set():
                return
            self._claimed = True
        faulthandler.dump_traceback(file=self.terminal_fd, all_threads=True)
        main = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(main)) if main is not None else ""
        detail = (
            f"timeout: still running after its budget + --grace ({task.timeout + self.grace:g} s);"
            f" the run stops here. Its Python stack:\n{stack}"
        )
        mine = RankResult(self.rank, TIMEOUT, None, detail, task.timeout + self.grace)
        code = EXIT_RANKS_LOST
        try:
            self._store.set(self._key("stuck", self.rank, seq), pickle.dumps(mine))
            end = time.monotonic() + LOSS_MARGIN
            while time.monotonic() < end and not all(
                self._store.check([self._key("result", r, seq)])
                or self._store.check([self._key("stuck", r, seq)])
                for r in range(self.world_size)
            ):
                time.sleep(0.1)
            results = self._collect(seq)
            self._say(task)
            if self.rank == 0:
                _write_stopped_run(self.session, results, self.stop_reason, self.terminal_fd)
            self._end_barrier()
        except BaseException:  # noqa: BLE001 - whatever happens, this process ends here
            os.write(self.terminal_fd, traceback.format_exc().encode())
            code = 3
        os._exit(code)

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

    def _say(self, task: Task) -> None:
        rest = (
            "rank 0 writes the partial reports"
            if 0 not in self.lost
            else "rank 0 is among them: no reports are written"
        )
        os.write(
            self.terminal_fd,
            f"fsdp conformance: rank {self.rank}: {self.stop_reason} during {task.fn} (results "
            f"waited for {self._waited} after the check started); the run stops, {rest}\n".encode(),
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


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _write_stopped_run(session, results: list[RankResult], reason: str, fd: int) -> None:
    """Rank 0's reports of a run stopped inside a check (see [Note: a stuck rank]): the check's
    case fails with every rank's result, the run is marked interrupted by ``reason``, and the
    JSON, Markdown and HTML reports go into the run's directory (pytest's JUnit XML cannot be
    written: the session never ends)."""
    from types import SimpleNamespace

    from conformance import plugin, reporting

    if session is None or session.run_dir is None:
        return
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    meta = session.meta.get(nodeid)
    if meta is not None:
        report = SimpleNamespace(
            nodeid=nodeid,
            duration=max(r.duration for r in results),
            failed=True,
            skipped=False,
            longrepr=plugin._format_failure(results),
            user_properties=[],
            rank_results=[r.__dict__.copy() for r in results],
        )
        session.records[nodeid] = reporting.case_record(report, meta, "fail")
    session.interrupted = reason
    reporting.write_files(session, time.time() - session.started, [], session.run_dir)
    reporting.keep_partial_run(session.run_dir)
    state = reporting.run_state(session)
    os.write(
        fd,
        f"{reporting.interrupted_line(state)}\npartial reports: {session.run_dir}/conformance."
        "{json,md,html} (marked interrupted; no JUnit XML: the run was stopped inside a check)\n".encode(),
    )
