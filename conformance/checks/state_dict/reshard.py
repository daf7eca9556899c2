"""Area "state_dict" (continued): checkpoints that change world size or implementation.

[Note: how a world-size-W1 checkpoint reaches a world-size-W2 check]
The harness runs one world size at a time, so a check at W2 cannot borrow a W1 group. Instead rank
0 of the W2 group *launches* a separate W1-rank job (processes forked from a save-job server,
running this module's ``_save_rank`` on a fresh loopback rendezvous) that shards ``Net(salt=0)`` with the same
implementation and writes its SHARDED state dict with ``torch.distributed.checkpoint.save`` (and, for
LOCAL, each rank's flat pieces with ``torch.save``) into a directory. Rank 0 broadcasts the
directory's path before it starts the job; the other ranks wait for the directory (or an error
file) to appear, outside any collective, and then ``dcp.load`` it into a fresh model at W2. The checkpoint content depends only on (implementation, W1), so it is written
once per run and reused by every world size: it lives under
``$TMPDIR/fsdp-conformance-sd-<driver pid>/`` (``lifeline.driver_pid``); the driver removes
it at exit, and a driver killed outright leaves it to the next run, which removes it. The job's
processes die with the rank that started them, and when they overrun the check's budget their
stacks are reported (see ``_produce``). This works for
every (W1, W2) pair, on one node (the ranks must share the file system).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import (
    AREA,
    NET_PLAN,
    Net,
    assert_loaded,
    broadcast_from_rank0,
    build,
    first_error_everywhere,
    full_kind,
    plain_reference,
)
from conformance.registry import check

_PREFIX = "fsdp-conformance-sd-"
_JOB_TIMEOUT = 200  # seconds for the save job (4 fresh interpreters on a loaded 2-core box)


def sharded_kind(impl) -> str:
    if base.SHARDED_STATE_DICT in impl.capabilities:
        return "sharded"
    if base.DTENSOR_STATE_DICT in impl.capabilities:
        return "dcp-sharded"
    raise NotSupported(f"{base.SHARDED_STATE_DICT} or {base.DTENSOR_STATE_DICT}")


def _impl_spec(ctx) -> str:
    """The spec string this process loaded ``ctx.impl`` from (a subprocess loads it again)."""
    from conformance.runner.execute import _IMPLS

    for spec, impl in _IMPLS.items():
        if impl is ctx.impl:
            return spec
    return ctx.impl.name


def _cache_root() -> Path:
    from conformance.runner import lifeline

    lifeline.remove_stale_dirs()
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{lifeline.driver_pid()}"


# The save jobs' ranks are forked from one server process per worker, started on first use with
# torch and this module imported (``multiprocessing``'s forkserver): a job rank then starts in
# milliseconds instead of paying a fresh interpreter and torch import (40 of them in the default
# matrix). The server dies with the worker (it exits when the worker's end of its pipe closes) and
# sits in the worker's process group, which the driver kills; each job rank also asks for a death
# signal. See [Note: no orphans] in conformance.runner.lifeline.
_JOB_PRELOAD = ["conformance.checks.state_dict.reshard", "torch._dynamo"]
IN_SAVE_JOB = False  # True in a save job's rank (lets a self-test fault hit only the job)


def _job_context():
    from conformance.runner import lifeline

    return lifeline.forkserver_context(_JOB_PRELOAD)


def _produce(ctx, spec: str, w1: int, directory: Path, deadline: float) -> None:
    """Run a W1-rank job that writes ``Net(0)``'s sharded (and local) state dict to ``directory``;
    at ``deadline`` (a ``time.monotonic()`` value) its ranks' stacks are taken and it is killed."""
    from conformance.runner.pool import free_port

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    port = free_port()
    logs = [tmp.with_name(f"{tmp.name}.rank{rank}.log") for rank in range(w1)]
    procs = [
        _job_context().Process(
            target=_save_rank,
            args=(str(tmp), spec, w1, rank, port, ctx.device.type, ctx.backend, str(logs[rank])),
            name=f"fsdp-conformance-save-ws{w1}-rank{rank}",
        )
        for rank in range(w1)
    ]
    for proc in procs:
        proc.start()
    hung = False
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            hung = True
            for p in procs:  # every live rank writes its stacks to its log (faulthandler)
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
            for p in procs:
                p.kill()
                p.join()
    # A rank that wrote its marker finished its part (the barrier after the writes passed); a
    # non-zero exit after that is process teardown (seen once: gloo's threads aborting the
    # interpreter at exit under load) and does not spoil the checkpoint.
    failed = [
        (r, p.exitcode, logs[r].read_text(errors="replace")[-6000:] if logs[r].exists() else "")
        for r, p in enumerate(procs)
        if p.exitcode != 0 and not (tmp / f"rank{r}.done").exists()
    ]
    for log in logs:
        log.unlink(missing_ok=True)
    if failed:
        why = "did not finish in time and was killed; its ranks' stacks" if hung else "failed"
        raise RuntimeError(
            f"the world-size-{w1} save job {why}:\n"
            + "\n".join(f"--- rank {r} (exit {code}):\n{out}" for r, code, out in failed)
        )
    tmp.rename(directory)


def checkpoint_dir(ctx, w1: int) -> Path:
    """The directory holding ``Net(0)`` saved by this implementation at world size ``w1``.

    Rank 0 broadcasts the path first and then runs the save job while the other ranks wait for
    the directory (or an error file) to appear on disk: no collective is pending during the job,
    so a slow job cannot trip the process group's timeout."""
    directory = error_file = None
    if ctx.rank == 0:
        spec = _impl_spec(ctx)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)
        directory = _cache_root() / f"{safe}-ws{w1}"
        error_file = directory.with_name(directory.name + ".error")
        error_file.unlink(missing_ok=True)
    directory = Path(broadcast_from_rank0(ctx, str(directory)))
    error_file = directory.with_name(directory.name + ".error")
    # The job gets the check's time less a margin for reporting its failure (stacks included).
    job_time = min(_JOB_TIMEOUT, 0.85 * ctx.time_left() - 5)
    if ctx.rank == 0 and not directory.exists():
        # One retry, within the same time budget: a job that crashed leaves only its log.
        deadline = time.monotonic() + job_time
        for attempt in (1, 2):
            try:
                _produce(ctx, spec, w1, directory, deadline)
                break
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                if attempt == 2 or time.monotonic() > deadline - 30:
                    error_file.write_text(f"{type(exc).__name__}: {exc}")
                    break
    deadline = time.monotonic() + job_time + 2
    while not directory.exists() and not error_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    ctx.barrier()
    if not directory.exists():
        text = error_file.read_text() if error_file.exists() else "no result within the deadline"
        raise AssertionError(
            f"{ctx.where()} could not write the world-size-{w1} checkpoint: {text}"
        )
    return directory


def _save_rank(directory, spec, ws, rank, port, device, backend, log_path) -> None:
    """One rank of the save job (see the module docstring), in a process forked for it."""
    global IN_SAVE_JOB
    from conformance.runner import lifeline

    lifeline.die_with_parent()
    IN_SAVE_JOB = True
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's way to see a hang
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp

    from conformance.adapters.registry import load_implementation
    from conformance.context import CheckContext

    dev = torch.device(device)
    if dev.type != "cpu":
        module = torch.get_device_module(dev.type)
        module.set_device(rank % module.device_count())
        dev = torch.device(dev.type, module.current_device())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws
    )
    try:
        impl = load_implementation(spec)
        ctx = CheckContext(rank=rank, world_size=ws, device=dev, backend=backend, impl=impl)
        model = impl.shard(Net(0).to(dev), ctx, plan=NET_PLAN)
        dcp.save(
            impl.state_dict(model, sharded_kind(impl)), checkpoint_id=os.path.join(directory, "dcp")
        )
        if base.LOCAL_STATE_DICT in impl.capabilities and ws > 1:
            pieces = {}
            for key, value in impl.state_dict(model, "local").items():
                if hasattr(value, "local_shards"):
                    shards = value.local_shards()
                    local = [
                        (list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in shards
                    ]
                    pieces[key] = ("flat", tuple(value.metadata().size), local)
                else:
                    pieces[key] = ("plain", None, value.detach().cpu())
            torch.save(pieces, os.path.join(directory, f"local-rank{rank}.pt"))
        dist.barrier()
        Path(directory, f"rank{rank}.done").touch()
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: the work is on disk, and C++ threads torn down at exit can abort.
    os._exit(0)


# ------------------------------------------------------------------------------------ checks
@check(area=AREA, cases={f"from-ws{w}": {"w1": w} for w in (1, 2, 3, 4)}, timeout=_JOB_TIMEOUT + 60)
def reshard_dcp(ctx, w1):
    """A sharded checkpoint written with ``torch.distributed.checkpoint.save`` by this
    implementation at world size ``w1`` loads (``dcp.load`` into this world size's sharded dict,
    then ``load_state_dict``) at every world size, giving the unwrapped model's values."""
    import torch.distributed.checkpoint as dcp

    kind = sharded_kind(ctx.impl)
    directory = checkpoint_dir(ctx, w1)
    dst = build(ctx, salt=1)
    sd = ctx.impl.state_dict(dst, kind)
    first_error_everywhere(ctx, lambda: dcp.load(sd, checkpoint_id=str(directory / "dcp")))
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    assert_loaded(
        ctx, dst, plain_reference(Net, 0), f"after loading the world-size-{w1} checkpoint"
    )


@check(area=AREA, requires={base.LOCAL_STATE_DICT}, world_sizes=(2,), timeout=_JOB_TIMEOUT + 60)
def local_reshard_4_to_2(ctx):
    """S7 (upstream's 4 -> 2 LOCAL reshard): the flat pieces of a world-size-4 LOCAL state dict,
    reassembled and re-chunked by the flat rule for 2 ranks (``init_from_local_shards``), load as
    a LOCAL state dict at world size 2 and give the unwrapped model's values."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    directory = checkpoint_dir(ctx, 4)
    per_rank = [torch.load(directory / f"local-rank{r}.pt", weights_only=False) for r in range(4)]
    sd = {}
    for key, (what, size, value) in per_rank[0].items():
        if what == "plain":
            sd[key] = value.to(ctx.device)
            continue
        full = torch.zeros(size, dtype=torch.float32)
        for pieces in per_rank:
            for offsets, tensor in pieces[key][2]:
                full[offsets[0] : offsets[0] + tensor.numel()] = tensor
        start, end, _ = flat_range(size[0], ctx.world_size, ctx.rank)
        shards = []
        if end > start:
            meta = ShardMetadata([start], [end - start], f"rank:{ctx.rank}/{ctx.device}")
            shards.append(Shard(full[start:end].clone().to(ctx.device), meta))
        sd[key] = init_from_local_shards(shards, size)
    dst = build(ctx, salt=1)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, "local"))
    assert_loaded(ctx, dst, plain_reference(Net, 0), "after loading the world-size-4 LOCAL pieces")


PARTNERS = ("torch-fsdp1", "reference-fsdp1", "torch-fsdp2", "reference", "unwrapped")


@check(area=AREA, cases={f"with-{p}": {"partner": p} for p in PARTNERS})
def interop_full(ctx, partner):
    """A full state dict (FSDP1 FULL, FSDP2 ``dcp-full``) saved by this implementation loads into
    the partner implementation (or an unwrapped model, strictly), and the partner's loads into
    this one: the loaded parameters and buffers equal the saved model's."""
    from conformance.adapters.registry import ImplementationLoadError, load_implementation

    mine = full_kind(ctx.impl)
    other = None
    if partner != "unwrapped":
        if partner == ctx.impl.name:
            raise NotSupported("the same implementation (see round_trip)")
        try:
            other = load_implementation(partner)
        except ImplementationLoadError as exc:
            raise NotSupported(
                f"partner {partner} unavailable: {str(exc).splitlines()[0]}"
            ) from exc
        theirs = full_kind(other)
    # this implementation -> partner
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(build(ctx, salt=0), mine))
    expected = plain_reference(Net, 0)
    if other is None:
        plain = Net(1)
        plain.load_state_dict({k: v.cpu() for k, v in sd.items()})  # strict
        got = plain_reference_of(plain)
        for k, v in expected.items():
            assert torch.equal(got[k], v), (
                f"{ctx.where()} unwrapped model after loading: {k} differs"
            )
    else:
        dst = build(ctx, salt=1, impl=other)
        first_error_everywhere(ctx, lambda: other.load_state_dict(dst, sd, theirs))
        assert_loaded(
            ctx, dst, expected, f"{partner} after loading {ctx.impl.name}'s {mine} dict", impl=other
        )
    # partner -> this implementation
    expected = plain_reference(Net, 2)
    if other is None:
        sd = {k: v.to(ctx.device) for k, v in Net(2).state_dict().items()}
    else:
        sd = first_error_everywhere(
            ctx, lambda: other.state_dict(build(ctx, salt=2, impl=other), theirs)
        )
    dst = build(ctx, salt=3)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, mine))
    assert_loaded(ctx, dst, expected, f"{ctx.impl.name} after loading {partner}'s full dict")


def plain_reference_of(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
