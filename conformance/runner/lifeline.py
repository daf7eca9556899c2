"""Tying every process the harness starts to the driver's life.

[Note: no orphans]
* Each worker makes itself the leader of a new process group; the driver ends a worker by killing
  that whole group, so whatever the worker started (a save job, a check's own subprocess) goes too.
  Ctrl-C and SIGTERM in the driver end in that kill (the plugin turns SIGTERM into an interrupt).
* Workers are forked from the driver's ``multiprocessing`` forkserver (started once per run with
  torch imported, so a group starts in a fraction of a second), which exits when the driver dies.
  Each worker and each save job asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``, Linux), and exits at once if the driver is already gone by the time it
  asks. This covers a SIGKILL of the driver, also during start-up.
* A worker also runs a watchdog thread that waits for end-of-file on a pipe only the driver holds
  (``multiprocessing``'s parent sentinel) and then kills its own process group: the fallback where
  ``PR_SET_PDEATHSIG`` does not exist.
* The checkpoint save jobs (conformance/checks/state_dict/reshard.py) are forked from a server
  process in the worker's process group that exits with the worker; each job rank asks for the
  death signal too.
* Temporary directories carry the driver's pid in their name (the checkpoint cache too: a worker
  is told its driver's pid, :func:`driver_pid`); the driver removes its own and its children's at
  exit, and a later run removes those whose process is gone
  (:func:`remove_stale_dirs`), which covers a driver killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
from multiprocessing.connection import wait
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent exits, and exit now if the parent is already gone (it
    may have died before the request was made): the process ``parent_pid``, else the
    ``multiprocessing`` parent, whose pipe ``parent_process().sentinel`` ends when it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watchdog and the driver's kill remain
        pass
    parent = multiprocessing.parent_process()
    if parent_pid is not None:
        if os.getppid() != parent_pid:
            os._exit(1)
    elif parent is not None and wait([parent.sentinel], timeout=0):
        os._exit(1)


_DRIVER_PID: int | None = None  # set in a worker rank: the pid of the run's driver


def set_driver_pid(pid: int) -> None:
    """Record the pid of the driver this worker rank serves (see :func:`driver_pid`)."""
    global _DRIVER_PID
    _DRIVER_PID = pid


def driver_pid() -> int:
    """The pid of the process that runs the suite: the driver in a worker rank (told at start),
    else this process (the driver itself, or a rank under torchrun). Names the run's temporary
    directories, which :func:`remove_stale_dirs` removes once that process is gone."""
    return os.getpid() if _DRIVER_PID is None else _DRIVER_PID


STARTER_ENV = "FSDP_CONFORMANCE_FORKSERVER_STARTER"  # pid of the process starting a forkserver


def forkserver_context(preload: list[str]):
    """``multiprocessing``'s forkserver context, its server importing ``preload`` once; the
    server dies with this process (``conformance.runner.forkserver_guard``). Falls back to
    ``spawn`` where there is no forkserver."""
    try:
        context = multiprocessing.get_context("forkserver")
    except ValueError:
        return multiprocessing.get_context("spawn")
    os.environ[STARTER_ENV] = str(os.getpid())
    context.set_forkserver_preload(["conformance.runner.forkserver_guard", *preload])
    return context


def lead_process_group() -> None:
    """Make this process the leader of a new process group (see the Note)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def watch_parent() -> None:
    """Start a daemon thread that kills this process's group once its ``multiprocessing`` parent
    (the driver) is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watchdog():
        wait([parent.sentinel])
        if os.getpgrp() == os.getpid():  # never the driver's group (it may hold a shell pipeline)
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watchdog, name="fsdp-conformance-parent-watchdog", daemon=True).start()


def kill_tree(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the process and its descendants), else ``pid``."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue
        except PermissionError:
            return


TEMP_PREFIX = "fsdp-conformance-"
_TEMP_NAME = re.compile(TEMP_PREFIX + r"[a-z]+[0-9]*-([0-9]+)(-.*)?")  # <kind>-<driver pid>[-*]


def temp_dir(kind: str) -> str:
    """A new directory ``$TMPDIR/fsdp-conformance-<kind>-<driver pid>-*``."""
    remove_stale_dirs()
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{kind}-{os.getpid()}-")


def child_pids(pid: int) -> set[int]:
    """The pids of ``pid``'s direct children (``/proc``; empty where there is none)."""
    children = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            children.add(int(entry.name))
    return children


def remove_stale_dirs(owner: int | None = None) -> None:
    """Remove the harness's temporary directories of process ``owner`` and of its children (the
    forkserver the workers come from names the checkpoint cache: a worker's parent), or (None)
    of every process that no longer exists. The pid in a name is the driver's or its child's."""
    owners = {owner} | child_pids(owner) if owner is not None else set()
    for path in Path(tempfile.gettempdir()).glob(TEMP_PREFIX + "*"):
        match = _TEMP_NAME.fullmatch(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if owner is not None:
            if pid in owners:
                shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass
