"""The main loop of one rank's worker process.

A worker joins the process group once, then serves tasks from its pipe until it receives ``None``.
It ignores Ctrl-C (the driver owns shutdown), dies with its parent (``PR_SET_PDEATHSIG``), and dumps
every thread's Python stack to its stack file when it receives ``SIGUSR1`` (the driver's way to see
where a hung rank is).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
from datetime import timedelta

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the driver's cleanup still kills us
        pass


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    backend: str,
    conn,
    stack_path: str,
    threads: int,
    init_timeout: float,
) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    import torch
    import torch.distributed as dist

    from conformance.runner.execute import execute

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type != "cpu":
        torch.get_device_module(dev.type).set_device(
            rank % torch.get_device_module(dev.type).device_count()
        )
        dev = torch.device(dev.type, torch.get_device_module(dev.type).current_device())
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=init_timeout),
            **({"device_id": dev} if dev.type != "cpu" else {}),
        )
    except Exception as exc:  # noqa: BLE001
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(3)
    # Import the heavy modules before reporting ready, so the first check's timeout does not pay
    # for them (several seconds on a loaded 2-core machine).
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    conn.send(("ready", os.getpid()))
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            conn.send(execute(task, rank, world_size, dev, backend))
    except (EOFError, BrokenPipeError):  # the driver went away
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
