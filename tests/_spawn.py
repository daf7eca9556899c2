"""Run a function on N gloo ranks in fresh processes (for the project's own multi-rank unit tests).

Usage inside a test::

    from tests._spawn import run_on_ranks

    def _body(rank, world_size, arg):  # module-level, so it pickles
        ...                           # a gloo default group is initialised here
        return something_picklable

    results = run_on_ranks(_body, 2, arg)   # list indexed by rank; raises if any rank failed

Each call costs one spawn (2-4 s here): group many sub-cases inside one body.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
