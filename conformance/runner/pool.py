"""Worker processes for one (world size, device, backend), spawned once and reused.

[Note: fault handling]
A check runs on every rank. The driver waits for all ranks' results with the check's timeout.
* all ranks answer                     -> their results;
* a rank raises, others still running  -> the others get ``grace`` seconds; whoever is still running
                                          then is presumed stuck in a collective with the failed rank;
* the deadline passes                  -> every live rank's Python stack is dumped (SIGUSR1 +
                                          faulthandler) and attached to its result;
* a rank process dies                  -> its exit code / signal is reported.
In the last three cases the whole group is killed and is respawned lazily before the next check.
When every rank answered but not every rank finished cleanly (one raised while the others
returned, say), the group may still hold a collective that one rank started and the others never
joined; a bounded health probe (:func:`conformance.runner.worker.health_probe`, ``probe_timeout``
seconds) then decides between keeping the group and restarting it. So one bad check never poisons
the next. Worker processes (and whatever they start) die with the driver and are killed on
``close()`` (see [Note: no orphans] in :mod:`conformance.runner.lifeline`); their temporary
directory is removed with them.

[Note: bounded ranks]
A rank releases the process groups and caches a check created before it takes the next message
(see [Note: per-check cleanup] in :mod:`conformance.runner.resources`). What that misses (a thread
a check never joined, an implementation that keeps every model it sharded) is bounded here: after
each check the driver reads every rank's thread and file-descriptor counts and, when one has grown
past its count at start-up by more than ``thread_headroom`` / ``fd_headroom``, recycles the group
(killed now, restarted before the next check; counted in ``recycles``). The counts lag one check
(the release runs when the next message arrives), so the headroom exceeds what one check creates.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from multiprocessing.connection import wait

from conformance.runner import memory, protocol
from conformance.runner.protocol import RankResult, Task

_LIVE_GROUPS: set[WorkerGroup] = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# [Note: a settled verdict]
# A case listed in an expectations file is an expected failure as soon as one rank's failure fits
# the entry's signature (``Entry.mismatch``: one fitting rank suffices), so what the other ranks do
# afterwards cannot change its verdict. The ranks of such a case get ``SETTLED_GRACE`` seconds
# after that failure, not ``--grace``: a listed deviation in which one rank raises while the
# others wait in a collective (FSDP1's FULL offload on CPU, say) costs its respawn, not five
# seconds of waiting as well. A failure that does not fit still gets the full grace, so a
# differently failing case (a mutant, a regression) is reported from every rank as before.
SETTLED_GRACE = 0.5


class WorkerGroupError(RuntimeError):
    """The group could not be started (rendezvous failed, a worker died during start-up)."""


class WorkerGroup:
    """``world_size`` worker processes joined in one process group."""

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        backend: str = "gloo",
        *,
        threads_per_rank: int = 1,
        grace: float = 5.0,
        start_timeout: float = 120.0,
        probe_timeout: float = 5.0,
        thread_headroom: int | None = 128,
        fd_headroom: int | None = 256,
        memory_limit: int | None = None,
    ):
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.threads_per_rank = threads_per_rank
        self.grace = grace
        self.start_timeout = start_timeout
        self.probe_timeout = probe_timeout
        self.thread_headroom = thread_headroom
        self.fd_headroom = fd_headroom
        self.memory_limit = (
            memory_limit  # bytes per rank (see [Note: rank memory limit]); None: off
        )
        self.spawn_count = 0  # how many times the group was (re)started
        self.probe_failures = 0  # how many health probes found the group broken
        self.recycles = 0  # how many times the group outgrew its headroom and was restarted
        self._start_counts: list[tuple[int | None, int | None]] = []  # per rank: threads, fds
        self._procs: list = []
        self._conns: list = []
        self._stack_dir: str | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.kill()
        from conformance.runner import lifeline

        self._stack_dir = lifeline.temp_dir(f"ws{self.world_size}")
        ctx = _context()
        port = free_port()
        _LIVE_GROUPS.add(self)
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_entry,
                args=(
                    rank,
                    self.world_size,
                    port,
                    self.device,
                    self.backend,
                    child_conn,
                    self._stack_path(rank),
                    self.threads_per_rank,
                    self.start_timeout,
                    os.getpid(),
                ),
                name=f"fsdp-conformance-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        deadline = time.monotonic() + self.start_timeout
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                reason = _exit_reason(self._procs[rank].exitcode)
                self.kill()
                raise WorkerGroupError(
                    f"rank {rank} of a world-size-{self.world_size} {self.backend} group did not "
                    f"come up within {self.start_timeout:.0f} s ({reason})"
                )
            try:
                msg = conn.recv()
            except EOFError:
                msg = (
                    "failed",
                    _exit_reason(self._procs[rank].join(5) or self._procs[rank].exitcode),
                )
            if msg[0] != "ready":
                self.kill()
                raise WorkerGroupError(f"rank {rank} failed to join the process group: {msg[1]}")
        self.spawn_count += 1
        self._start_counts = [self._counts(rank) for rank in range(self.world_size)]

    def close(self) -> None:
        """Ask workers to exit; kill whoever does not within a few seconds."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker with its process group (what it started goes too); remove the
        group's temporary directory."""
        from conformance.runner import lifeline

        for proc in self._procs:
            if proc.pid is not None:
                lifeline.kill_tree(proc.pid)
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
            self._stack_dir = None
        _LIVE_GROUPS.discard(self)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---------------------------------------------------------------- running
    def run(self, task: Task, settled=None) -> list[RankResult]:
        """Run ``task`` on every rank; never raises for a misbehaving check. Afterwards the group
        is either healthy or killed (see [Note: fault handling]). ``settled(result)``, when
        given, tells whether one rank's failure already decides the case's verdict (see
        [Note: a settled verdict])."""
        self.start()
        results, torn_down = self._collect(
            task, task.timeout, what=task.timeout_text, settled=settled
        )
        statuses = {r.status for r in results}
        # clean: every rank ended the same way (returned, not supported, skipped), no rank raised
        clean = len(statuses) == 1 and protocol.ERROR not in statuses
        if torn_down or protocol.DIED in statuses:
            self.kill()  # respawned lazily by the next run()
        elif not clean and not self.healthy():
            self.probe_failures += 1
            self.kill()
        elif (
            any(r.recycle for r in results) or self.outgrown()
        ):  # global state it could not put back
            self.recycles += 1
            self.kill()
        return results

    def _counts(self, rank: int) -> tuple[int | None, int | None]:
        from conformance.runner.resources import fd_count, thread_count

        pid = self._procs[rank].pid
        return thread_count(pid), fd_count(pid)

    def outgrown(self) -> bool:
        """Whether some rank holds more threads or file descriptors than at start-up plus the
        headroom (see [Note: bounded ranks]); False where ``/proc`` cannot tell."""
        limits = (self.thread_headroom, self.fd_headroom)
        for rank, start in enumerate(self._start_counts):
            for now, then, headroom in zip(self._counts(rank), start, limits):
                if None not in (now, then, headroom) and now > then + headroom:
                    return True
        return False

    def healthy(self) -> bool:
        """Whether every rank passes the health probe within ``probe_timeout`` seconds."""
        if not self.alive:
            return False
        results, torn_down = self._collect(protocol.PROBE, self.probe_timeout, stacks=False)
        return not torn_down and all(r.ok for r in results)

    def _collect(
        self, message, timeout: float, *, what: str = "", stacks: bool = True, settled=None
    ) -> tuple[list[RankResult], bool]:
        """Send ``message`` to every rank and gather the answers within ``timeout`` seconds;
        returns them and whether ranks had to be given up on (stuck or timed out)."""
        for conn in self._conns:
            conn.send(message)
        sent = time.monotonic()
        results: dict[int, RankResult] = {}
        deadline = sent + timeout
        first_error_at: float | None = None
        grace = self.grace  # what the other ranks get once one failed
        torn_down = False
        while len(results) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in results]
            limit = deadline
            if first_error_at is not None:
                limit = min(deadline, first_error_at + grace)
            timeout = max(0.0, limit - time.monotonic())
            if self.memory_limit is not None:
                timeout = min(timeout, memory.POLL_S)
            ready = wait(
                [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                timeout=timeout,
            )
            if self.memory_limit is not None and not ready:
                for rank, used in self._over_memory(pending):
                    results[rank] = RankResult(
                        rank,
                        protocol.DIED,
                        detail=f"rank {rank} exceeded its {memory.format_size(self.memory_limit)} "
                        f"memory limit in {getattr(message, 'case', '') or 'this check'} (resident "
                        f"{memory.format_size(used)}; killed; see --rank-memory-limit)",
                        duration=time.monotonic() - sent,
                    )
                    if first_error_at is None:
                        first_error_at = time.monotonic()
            for rank in pending:
                conn, proc = self._conns[rank], self._procs[rank]
                if conn in ready:
                    try:
                        results[rank] = conn.recv()
                    except (EOFError, OSError):
                        results[rank] = self._died(rank, sent)
                elif proc.sentinel in ready:
                    results[rank] = self._died(rank, sent)
                else:
                    continue
                if results[rank].ok:
                    continue
                if first_error_at is None:
                    first_error_at = time.monotonic()
                if settled is not None and grace > SETTLED_GRACE and settled(results[rank]):
                    grace, first_error_at = SETTLED_GRACE, time.monotonic()
            if len(results) < self.world_size and time.monotonic() >= limit:
                stuck = [r for r in range(self.world_size) if r not in results]
                dumped = self.dump_stacks() if stacks else {}
                why = (
                    f"did not finish within {what or f'{timeout:g} s'}"
                    if time.monotonic() >= deadline
                    else f"still running {grace:g} s after another rank failed"
                )
                elapsed = time.monotonic() - sent
                for rank in range(self.world_size):
                    stack = dumped.get(rank, "(not captured)")
                    if rank in stuck:
                        results[rank] = RankResult(
                            rank,
                            protocol.TIMEOUT,
                            detail=f"rank {rank} {why}; its stack:\n{stack}",
                            duration=elapsed,
                        )
                    elif stacks:  # finished its part: its stack shows where it waits instead
                        results[rank].detail += (
                            f"\n(rank {rank} had returned; its stack at teardown:)\n{stack}"
                        ).lstrip("\n")
                torn_down = True
        return [results[r] for r in range(self.world_size)], torn_down

    def _over_memory(self, ranks) -> list[tuple[int, int]]:
        """The ranks among ``ranks`` above the memory limit, with their resident sets; each is
        killed now with its process group (see [Note: rank memory limit])."""
        from conformance.runner import lifeline

        over = []
        for rank in ranks:
            used = memory.resident(self._procs[rank].pid)
            if used is not None and used > self.memory_limit:
                lifeline.kill_tree(self._procs[rank].pid)
                self._procs[rank].join(5)
                over.append((rank, used))
        return over

    def _died(self, rank: int, sent: float) -> RankResult:
        proc = self._procs[rank]
        proc.join(2)
        return RankResult(
            rank,
            protocol.DIED,
            detail=_exit_reason(proc.exitcode),
            duration=time.monotonic() - sent,
        )

    def dump_stacks(self, settle: float = 0.5) -> dict[int, str]:
        """Every live rank's Python stacks (all threads), via SIGUSR1 -> faulthandler."""
        offsets = {}
        for rank, proc in enumerate(self._procs):
            path = self._stack_path(rank)
            offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(settle)
        stacks = {}
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                stacks[rank] = f"(no stack: process {_exit_reason(proc.exitcode)})"
                continue
            with open(self._stack_path(rank)) as f:
                f.seek(offsets[rank])
                stacks[rank] = f.read().strip() or "(no stack written)"
        return stacks

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stacks")


# Imported once by the forkserver the workers are forked from (see _context).
_WORKER_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",  # imported by the first fully_shard call otherwise (1-2 s per process)
    "conformance.runner.worker",
    "conformance.runner.execute",
]


def _context():
    """Workers are forked from ``multiprocessing``'s forkserver, started once per driver with
    torch and the distributed packages imported: a group of N ranks then starts in about the time
    of its rendezvous, not N fresh interpreters importing torch (seconds each, and ranks share the
    cores). The forkserver never initialises a device or a process group, so forking it is safe."""
    from conformance.runner import lifeline

    return lifeline.forkserver_context(_WORKER_PRELOAD)


def _worker_entry(*args) -> None:
    from conformance.runner.worker import worker_main

    worker_main(*args)


def kill_all_groups() -> None:
    """Tear down every live group (called at exit and on interrupt)."""
    for group in list(_LIVE_GROUPS):
        group.kill()


def _at_exit() -> None:
    from conformance.runner import lifeline

    kill_all_groups()
    lifeline.remove_stale_dirs(owner=os.getpid())  # e.g. the checkpoint cache of the save jobs


import atexit  # noqa: E402

atexit.register(_at_exit)
