"""Releasing what a check leaves behind in a rank that serves many checks.

[Note: per-check cleanup]
A worker rank runs hundreds of checks in one process, so whatever a check creates and torch keeps
must be given back when the check ends, or a long run grows without bound.
* Process groups. ``new_group`` registers a group in c10d's world tables (``_world.pg_map`` and its
  siblings) and in the C++ table of group names, which keep it for the life of the process. A
  ``DeviceMesh`` of two or more dimensions makes a group per dimension (a 1-D mesh over all ranks
  reuses the default group), and so do a flattened mesh, the post-forward mesh of an integer
  ``reshard_after_forward``, FSDP1's hybrid sharding and any check that calls ``new_group``. A gloo
  group holds about three threads and a socket per peer.
* So the rank notes the groups that exist before each task (:meth:`Ledger.begin`), and when the
  next message arrives it destroys those created since (:meth:`Ledger.release`). By then every
  rank has finished the check (the driver sends nothing new before every rank answered), so no
  collective is in flight on them; destroying is local, and every rank destroys the same groups,
  so the names of later groups stay in step across ranks. The default group is never touched, and
  neither are the groups of the meshes the harness caches for reuse (``conformance.context``: one
  mesh per shape, bounded), which later checks keep using, nor the groups named by their ranks
  outside a mesh (``new_group(..., use_local_synchronization=True)``, e.g. FSDP2's
  ``set_separate_reduce_scatter_group``): c10d hashes such a name from the ranks and the number of
  live groups, so once the group is destroyed the next group of the same ranks gets the same
  name, and gloo's rendezvous for it reads the destroyed group's addresses from the store (the
  keys stay): a rank that gets there first connects to a closed socket and the group never forms
  ("timed out connecting ... Connection refused"; torch 2.13, seen when a second check set a
  separate reduce-scatter group). Kept alive, the next one gets a new name and forms. Few checks
  make such groups, and a worker that holds too many threads is recycled anyway (below).
* A destroyed group's threads end only when its last Python reference goes. Meshes hold their
  groups, objects a check built (an FSDP module and its state) often sit in reference cycles, and
  DTensor's sharding caches keep the first mesh of each shape they saw (their keys compare meshes
  by shape and names). So after destroying, the release clears those caches and runs the garbage
  collector; that is cheap because the worker freezes its start-up objects (``gc.freeze``), and it
  only happens after a check that created groups. The groups themselves are freed by a reaper
  thread (freeing one joins its threads: tens of milliseconds), while the rank goes on.
* The rest (threads a check starts and never joins, sockets, anything torch caches that this
  module does not know) is bounded from outside: the driver reads every rank's thread and file
  descriptor counts after each check and recycles the group when they pass a limit (see
  :meth:`conformance.runner.pool.WorkerGroup.run`).
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import weakref


def thread_count(pid: int | str = "self") -> int | None:
    """How many threads process ``pid`` has (``/proc``; None where there is none)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def fd_count(pid: int | str = "self") -> int | None:
    """How many file descriptors process ``pid`` holds open (``/proc``; None where there is none)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _world():
    from torch.distributed import distributed_c10d

    return distributed_c10d._world


def live_groups() -> list:
    """The process groups c10d holds now, the default group excluded, oldest first."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    world = _world()
    default = world.default_pg
    return [pg for pg in world.pg_map if pg is not default]


def _cached_mesh_group_names() -> set[str]:
    """Names of the groups used by the meshes the harness keeps across checks."""
    context = sys.modules.get("conformance.context")  # not imported: no cached mesh yet
    meshes = context.cached_meshes() if context is not None else []
    names: set[str] = set()
    while meshes:
        mesh = meshes.pop()
        names.update(getattr(mesh, "_dim_group_names", ()))
        names.update(getattr(mesh, "_pg_registry", {}))
        meshes.extend(getattr(mesh, "_flatten_mapping", {}).values())
    return names


def _named_by_ranks(pg, names) -> bool:
    """Whether c10d named ``pg`` by a hash of its ranks (``use_local_synchronization=True``; a
    counter names the others) outside a ``DeviceMesh`` (see [Note: per-check cleanup])."""
    name = names.get(pg, "")
    hashed = len(name) == 40 and all(c in "0123456789abcdef" for c in name)
    return hashed and not str(getattr(pg, "group_desc", "")).startswith("mesh")


def _clear_mesh_caches() -> None:
    """Drop DTensor's caches that hold meshes (and through them process groups): the sharding
    propagation caches (the Python one of this thread and the C++ fast path's), the tensor-meta,
    redistribution-plan and mesh-topology caches. All are torch internals that may move: a
    missing one is skipped."""
    import torch

    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        type(propagator)._propagate_tensor_meta_cached.cache_clear()
    except (ImportError, AttributeError):
        pass
    try:
        from torch.distributed.tensor import _redistribute

        _redistribute._gen_transform_infos.cache_clear()
        _redistribute._planner_cache.clear()
    except (ImportError, AttributeError):
        pass
    try:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        MeshTopoInfo.build_from_mesh.cache_clear()
    except (ImportError, AttributeError):
        pass


class _Reaper:
    """A thread that drops the last references to destroyed groups. Freeing a gloo group joins
    its threads, which takes tens of milliseconds per group (its threads wake on their own
    schedule); the rank meanwhile goes on with the next task."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None

    def drop(self, objects: list) -> None:
        """Take ``objects`` (the caller keeps no other reference) and let them go."""
        with self._done:
            self._pending += 1
        self._queue.put(objects)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="fsdp-conformance-reaper", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            objects = self._queue.get()
            objects.clear()
            del objects
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until everything handed over is dropped; False if ``timeout`` seconds pass."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)


class Ledger:
    """The groups a rank had before the current task, and the ones it destroyed since."""

    def __init__(self) -> None:
        self._before: set = set()
        self._pending = False
        self._released: list[weakref.ref] = []
        self._reaper = _Reaper()
        self.destroyed = 0  # groups destroyed so far

    def begin(self) -> None:
        """Note the groups that exist now; call before running a task."""
        self._before = set(live_groups())
        self._pending = True

    def release(self) -> int:
        """Destroy the groups created since :meth:`begin` (but those of cached meshes), then
        drop what keeps them alive; returns how many were destroyed. Call on every rank at the
        same point, after every rank has finished the task."""
        if not self._pending:
            return 0
        self._pending = False
        doomed = self._destroy_fresh()
        self._before = set()
        if doomed:
            self.destroyed += len(doomed)
            # Free everything that refers to them here, but the groups themselves (and their
            # threads) in the reaper: this list holds the last references once gc is done.
            _clear_mesh_caches()
            gc.collect()
            self._reaper.drop(doomed)
        return len(doomed)

    def _destroy_fresh(self) -> list:
        import torch.distributed as dist

        keep = _cached_mesh_group_names()
        names = _world().pg_names
        fresh = [
            pg
            for pg in live_groups()
            if pg not in self._before and names[pg] not in keep and not _named_by_ranks(pg, names)
        ]
        for pg in reversed(fresh):
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001, S112 - c10d has dropped it or never will
                continue
            self._released.append(weakref.ref(pg))
        return fresh

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until the destroyed groups handed to the reaper are freed (for measurements)."""
        return self._reaper.settle(timeout)

    def lingering(self) -> int:
        """Destroyed groups that something still references (their threads still run)."""
        self._released = [ref for ref in self._released if ref() is not None]
        return len(self._released)


LEDGER = Ledger()  # the one ledger of this process (a worker rank, or a torchrun rank)
