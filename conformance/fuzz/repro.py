"""The standalone reproducer printed for a failing fuzz example.

The script spawns the world size's ranks itself (``torch.multiprocessing`` + a file rendezvous on a
fresh temporary file: no free port is picked and released, so no other process can take it between
the pick and the ranks' connect), builds the implementation in every rank as the run did, and calls
the fuzz check on the shrunk example. It puts the checkout that found the example and the import
path the run's adapter needed (``Rerun.paths``: ``$PYTHONPATH`` and the plug-in's ``sys.path``
entry, see ``conformance.reporting.import_paths``) on ``sys.path``, so it runs from any directory
in an environment with torch and the adapter's own dependencies.

[Note: repro exit codes]
1  reproduces: a rank failed inside the check (its traceback is printed, as in the run), or died
   there
0  passes: every rank ran the check on the example without failing (also when a rank then dies
   tearing its gloo process group down, which a loaded machine occasionally shows as a SIGABRT)
2  could not start: torch, the harness or the adapter could not be imported, or the process group
   could not be formed; nothing was checked (the cause is printed)
"""

from __future__ import annotations

import pprint
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPRODUCES, PASSES, COULD_NOT_START = 1, 0, 2

TEMPLATE = '''\
"""Reproduces {case_id} on {impl_name!r} ({impl_spec}), found by the conformance fuzzer.

Model:
{model}
Wrap plan (deepest first, root last): {plan}

Run: python this_file.py. Exit code 1: it reproduces (the failing rank's traceback is printed);
0: it passes here; 2: it could not start (torch, the harness or the adapter could not be imported,
or the process group could not be formed; nothing was checked).
"""

import os
import sys
import tempfile
import time
import traceback

REPRODUCES, PASSES, COULD_NOT_START = {codes}

# the fsdp-conformance checkout that found it, then the import path the run's adapter needed
IMPORT_PATH = {paths!r}
sys.path[:0] = [p for p in IMPORT_PATH if p not in sys.path]

CHECK = {check!r}
IMPL = {impl_spec!r}
WORLD_SIZE = {world_size}
DEVICE, BACKEND = {device!r}, {backend!r}
CASE = {case!r}
EXAMPLE = {example}


def could_not_start(why):
    print(f"could not start: {{why}}; nothing was checked (exit {{COULD_NOT_START}})", file=sys.stderr)
    return COULD_NOT_START


def rank_main(rank, tmp):
    import torch
    import torch.distributed as dist

    from conformance.adapters.registry import load_implementation
    from conformance.context import CheckContext
    from conformance.runner.protocol import resolve

    device = torch.device(DEVICE)
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        module.set_device(rank % module.device_count())
        device = torch.device(device.type, module.current_device())
    check, impl = resolve(CHECK), load_implementation(IMPL)
    dist.init_process_group(BACKEND, init_method=f"file://{{os.path.join(tmp, 'rendezvous')}}",
                            rank=rank, world_size=WORLD_SIZE)
    try:
        ctx = CheckContext(rank=rank, world_size=WORLD_SIZE, device=device, backend=BACKEND,
                           impl=impl)
        open(os.path.join(tmp, f"started-{{rank}}"), "w").close()  # from here on, it is the check
        try:
            check(ctx, example=EXAMPLE, **CASE)
        except BaseException:  # kept with its time: the first rank to fail is the cause
            with open(os.path.join(tmp, f"failed-{{rank}}"), "w") as out:
                out.write(f"{{time.monotonic()}}\\n{{traceback.format_exc()}}")
            raise
        dist.barrier()  # every rank is done before any tears its gloo pairs down (else SIGABRT)
        open(os.path.join(tmp, f"done-{{rank}}"), "w").close()  # the check passed on this rank
    finally:
        dist.destroy_process_group()


def main():
    try:
        import torch.multiprocessing as mp
    except Exception:
        traceback.print_exc()
        return could_not_start("torch cannot be imported here")
    # a file rendezvous in a fresh directory (the file must not exist before the ranks start);
    # the directory and everything in it go when the script ends
    with tempfile.TemporaryDirectory(prefix="fuzz-repro-") as tmp:
        try:
            mp.spawn(rank_main, args=(tmp,), nprocs=WORLD_SIZE)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failed = sorted(
                (float(when), rank, text)
                for rank in range(WORLD_SIZE)
                if os.path.exists(path := os.path.join(tmp, f"failed-{{rank}}"))
                for when, _, text in [open(path).read().partition("\\n")]
            )
            if failed:  # the check raised on a rank: its traceback, as in the run
                _, rank, text = failed[0]
                print(text, file=sys.stderr)
                print(f"reproduces: rank {{rank}} failed in {{CHECK}} (exit {{REPRODUCES}})",
                      file=sys.stderr)
                return REPRODUCES
            print(exc, file=sys.stderr)
            rank = exc.error_index
            if all(os.path.exists(os.path.join(tmp, f"done-{{r}}")) for r in range(WORLD_SIZE)):
                # every rank passed the check and the barrier after it: the crash is gloo's
                # teardown (an occasional SIGABRT on a loaded machine), not the example
                print(f"passed: the example does not reproduce here (rank {{rank}} then died "
                      "tearing its process group down)")
                return PASSES
            if os.path.exists(os.path.join(tmp, f"started-{{rank}}")):  # e.g. died in the check
                print(f"reproduces: rank {{rank}} ended in {{CHECK}} (exit {{REPRODUCES}})",
                      file=sys.stderr)
                return REPRODUCES
            return could_not_start(f"rank {{rank}} failed before the check ran (see above)")
        except Exception:
            traceback.print_exc()
            return could_not_start("the ranks could not be started")
    print("passed: the example does not reproduce here")
    return PASSES


if __name__ == "__main__":
    sys.exit(main())
'''


def snippet(meta, example: dict) -> str:
    """The reproducer of ``example`` for the case ``meta`` (a :class:`conformance.plugin.CaseMeta`)."""
    from conformance.fuzz import model as fm

    model = fm.build(example)
    rerun = getattr(meta, "rerun", None)
    return TEMPLATE.format(
        case_id=meta.case_id,
        impl_name=meta.impl_name,
        impl_spec=meta.impl_spec,
        model="\n".join("    " + line for line in repr(model).splitlines()),
        plan=fm.plan(example),
        codes=f"{REPRODUCES}, {PASSES}, {COULD_NOT_START}",
        paths=[str(ROOT), *getattr(rerun, "paths", ())],
        check=meta.spec.path,
        world_size=meta.world_size,
        device=meta.device,
        backend=meta.backend,
        case=dict(meta.spec.cases[meta.case]),
        example=pprint.pformat(example, indent=1, width=96, sort_dicts=False),
    )
