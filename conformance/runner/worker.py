"""The main loop of one rank's worker process.

A worker joins the process group once, then serves tasks from its pipe until it receives ``None``.
It ignores Ctrl-C (the driver owns shutdown), leads its own process group and dies with its parent
(see [Note: no orphans] in :mod:`conformance.runner.lifeline`), and dumps every thread's Python
stack to its stack file when it receives ``SIGUSR1`` (the driver's way to see where a hung rank is).
Besides tasks it answers :data:`~conformance.runner.protocol.PROBE` with :func:`health_probe`.
Before it handles a message it releases what the previous task created (process groups and the
caches that keep them alive; see [Note: per-check cleanup] in :mod:`conformance.runner.resources`).
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta

from conformance.runner import lifeline


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
    driver_pid: int,
) -> None:
    lifeline.die_with_parent()
    lifeline.set_driver_pid(driver_pid)
    lifeline.lead_process_group()
    lifeline.watch_parent()
    # The driver starts workers as daemons (never joined at its exit); a check may still start
    # processes of its own with multiprocessing (the save jobs), which daemons may not.
    multiprocessing.current_process().daemon = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    import torch
    import torch.distributed as dist

    from conformance.runner import protocol
    from conformance.runner.execute import execute
    from conformance.runner.resources import LEDGER

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

    # What exists now lives as long as the process: keep it out of the garbage collector's scans,
    # which makes the collection after each group-building check cheap (milliseconds).
    gc.freeze()
    conn.send(("ready", os.getpid()))
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            # Every rank has answered the previous task before the driver sends anything new.
            LEDGER.release()
            if task == protocol.PROBE:
                conn.send(health_probe(rank, world_size, dev))
            else:
                LEDGER.begin()
                conn.send(execute(task, rank, world_size, dev, backend))
    except (EOFError, BrokenPipeError):  # the driver went away
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def health_probe(rank: int, world_size: int, device):
    """A barrier and an all-reduce whose sum every rank checks. A group left with a collective
    pending on some ranks (a rank raised after starting an async all-reduce) cannot pass: the
    ranks' collective counts differ, so some rank's last call has no partner and hangs (the
    driver's probe timeout then restarts the group) or the sum comes out wrong."""
    import torch
    import torch.distributed as dist

    from conformance.runner.protocol import ERROR, OK, RankResult

    start = time.perf_counter()
    value = torch.tensor([float(rank + 1)], device=device)
    try:
        dist.barrier()
        dist.all_reduce(value)
        expected = world_size * (world_size + 1) / 2
        if value.item() != expected:
            raise RuntimeError(f"probe all-reduce gave {value.item()}, expected {expected}")
        status, detail = OK, ""
    except Exception as exc:  # noqa: BLE001 - an unhealthy group is reported, not raised
        status, detail = ERROR, f"{type(exc).__name__}: {exc}"
    return RankResult(rank, status, detail=detail, duration=time.perf_counter() - start)
