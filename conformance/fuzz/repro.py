"""The standalone reproducer printed for a failing fuzz example.

The script spawns the world size's ranks itself (``torch.multiprocessing`` + a file rendezvous on a
fresh temporary file: no free port is picked and released, so no other process can take it between
the pick and the ranks' connect), builds the implementation in every rank as the run did, and calls
the fuzz check on the shrunk example; a rank's assertion ends the script with exit code 1 and that
rank's traceback, exactly as in the run. It needs this project importable (run it from the
checkout, or with the project installed) and the implementation's adapter importable, as the run
did.
"""

from __future__ import annotations

import pprint
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEMPLATE = '''\
"""Reproduces {case_id} on {impl_name!r} ({impl_spec}), found by the conformance fuzzer.

Model:
{model}
Wrap plan (deepest first, root last): {plan}

Run: python this_file.py  (exit code 1 and the failing rank's traceback when it reproduces).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, {root!r})  # the fsdp-conformance checkout that found it

CHECK = {check!r}
IMPL = {impl_spec!r}
WORLD_SIZE = {world_size}
DEVICE, BACKEND = {device!r}, {backend!r}
CASE = {case!r}
EXAMPLE = {example}


def rank_main(rank, rendezvous):
    from conformance.adapters.registry import load_implementation
    from conformance.context import CheckContext
    from conformance.runner.protocol import resolve

    device = torch.device(DEVICE)
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        module.set_device(rank % module.device_count())
        device = torch.device(device.type, module.current_device())
    dist.init_process_group(BACKEND, init_method=f"file://{{rendezvous}}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        ctx = CheckContext(rank=rank, world_size=WORLD_SIZE, device=device, backend=BACKEND,
                           impl=load_implementation(IMPL))
        resolve(CHECK)(ctx, example=EXAMPLE, **CASE)
        dist.barrier()  # every rank is done before any tears its gloo pairs down (else SIGABRT)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # a file rendezvous in a fresh directory (the file must not exist before the ranks start);
    # the directory and everything in it go when the script ends
    with tempfile.TemporaryDirectory(prefix="fuzz-repro-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(rank_main, args=(rendezvous,), nprocs=WORLD_SIZE)  # raises if any rank raised
    print("passed: the example does not reproduce here")
'''


def snippet(meta, example: dict) -> str:
    """The reproducer of ``example`` for the case ``meta`` (a :class:`conformance.plugin.CaseMeta`)."""
    from conformance.fuzz import model as fm

    model = fm.build(example)
    return TEMPLATE.format(
        case_id=meta.case_id,
        impl_name=meta.impl_name,
        impl_spec=meta.impl_spec,
        model="\n".join("    " + line for line in repr(model).splitlines()),
        plan=fm.plan(example),
        root=str(ROOT),
        check=meta.spec.path,
        world_size=meta.world_size,
        device=meta.device,
        backend=meta.backend,
        case=dict(meta.spec.cases[meta.case]),
        example=pprint.pformat(example, indent=1, width=96, sort_dicts=False),
    )
