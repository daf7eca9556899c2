"""Areas "training", "states" and "extensions": FSDP2 runtime edges of the communication
setters and the iteration state (P75, P76, P77, P78), and the mesh an HSDP extension is handed
(P16).

[Note: one allocation strategy per unit]
A unit's all-gather buffers come from one place: the default allocator, the process group's own
allocator (``set_allocate_memory_from_process_group_for_comm(True)``), symmetric memory
(``set_symm_mem_for_comm()``) or a custom comm. Once the process-group allocator is on,
``set_symm_mem_for_comm()`` refuses the unit with AssertionError naming the all-gather comm in
place (``ProcessGroupAllocAllGather``); turned off again (``False``), the unit is back on the
default all-gather and that refusal is gone. Symmetric memory's only allocation backend is NCCL:
where torch has no NCCL (a CPU build) the setup itself then fails with RuntimeError naming NCCL
and the unit keeps its default all-gather, so training afterwards is unchanged; with NCCL any
outcome but that AssertionError is accepted (symmetric memory depends on the machine).

[Note: a failed standalone call claims the iteration]
The first unit whose pre-forward runs in an iteration takes the root's part for it (its
post-forward completes the groups that did not run in full, P22/P63). A unit called on its own
(a chunked loss calling a unit directly) takes that part too; if its forward raises, its
post-forward never gives the part back, and the next root forward would leave the completion to
that unit's post-forward (``inp``, run before the group: too early to complete it). ``reset_iter_state()`` on the root (P37) must clear the
claim with the rest: the next root forward then completes a group ``fully_shard([a, b])`` whose
``b`` it skipped, so the group is SHARDED right after that forward, and training equals the
unsharded model's (the oracle of ``grouped.py``).

[Note: the all-reduce hook's stream]
On a 1-D mesh there is no all-reduce; ``set_all_reduce_hook(hook, stream=s)`` runs the hook after
the reduce-scatter, inside ``s`` (the device module's stream context, which exists on CPU too:
``torch.cpu.current_stream()`` is ``s`` while it runs).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    assert_sharded_grad,
    backward_and_compare,
    make_batch,
    make_optimizer,
    per_sample_loss,
    shard_dim,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard import _subclasses
from conformance.checks.fully_shard.extensions import PairLinear
from conformance.checks.fully_shard.grouped import _assert_group_sharded, _batch
from conformance.checks.fully_shard.grouped_edges import TrunkTail
from conformance.registry import check


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.FSDP2_SYMM_MEM},
    world_sizes=(1, 2),
)
def symm_mem_after_pg_allocator(ctx):
    """P75: on the nested MLP, ``inp.set_allocate_memory_from_process_group_for_comm(True)`` then
    ``inp.set_symm_mem_for_comm()`` raises AssertionError naming ``ProcessGroupAllocAllGather``
    (the all-gather comm in place); after ``...for_comm(False)`` the same call no longer raises
    that AssertionError. Where torch has no NCCL (``torch.distributed.is_nccl_available()``
    False), symmetric memory has no allocation backend: the call raises RuntimeError naming NCCL
    and leaves the unit on its default all-gather, so one training step afterwards (sharded
    gradients, values after an SGD step) equals the unsharded model's."""
    import torch.distributed as dist

    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    model.inp.set_allocate_memory_from_process_group_for_comm(True)
    try:
        model.inp.set_symm_mem_for_comm()
    except AssertionError as exc:
        assert "ProcessGroupAllocAllGather" in str(exc), (
            f"{ctx.where()} set_symm_mem_for_comm() after the process-group allocator: "
            f"AssertionError {exc!r} does not name the all-gather comm ProcessGroupAllocAllGather"
        )
    except Exception as exc:  # noqa: BLE001 - the wrong error is the finding
        raise AssertionError(
            f"{ctx.where()} set_symm_mem_for_comm() after the process-group allocator raised "
            f"{type(exc).__name__}: {exc}; expected AssertionError naming "
            "ProcessGroupAllocAllGather (the allocator's all-gather comm was not installed)"
        ) from exc
    else:
        raise AssertionError(
            f"{ctx.where()} set_symm_mem_for_comm() after "
            "set_allocate_memory_from_process_group_for_comm(True) raised nothing; expected "
            "AssertionError naming ProcessGroupAllocAllGather"
        )
    model.inp.set_allocate_memory_from_process_group_for_comm(False)
    nccl = dist.is_nccl_available()
    what = "set_symm_mem_for_comm() after set_allocate_memory_from_process_group_for_comm(False)"
    try:
        model.inp.set_symm_mem_for_comm()
    except AssertionError as exc:
        raise AssertionError(
            f"{ctx.where()} {what} raised {exc!r}; the unit should be back on the default "
            "all-gather"
        ) from exc
    except RuntimeError as exc:
        if nccl:
            return  # symmetric memory itself may be unavailable on this machine (module note)
        assert "NCCL" in str(exc), (
            f"{ctx.where()} {what} without NCCL: RuntimeError {exc!r} does not name the missing "
            "allocation backend NCCL"
        )
    except Exception as exc:  # noqa: BLE001 - the wrong error is the finding without NCCL
        if nccl:
            return
        raise AssertionError(
            f"{ctx.where()} {what} without NCCL raised {type(exc).__name__}: {exc}; expected "
            "RuntimeError naming the missing allocation backend NCCL"
        ) from exc
    else:
        if nccl:
            return  # symmetric memory set up: its training is an accelerator matter
        raise AssertionError(
            f"{ctx.where()} {what} raised nothing although torch has no NCCL "
            "(dist.is_nccl_available() is False); expected RuntimeError naming the missing "
            "allocation backend NCCL"
        )
    # the refused call left the unit on its default all-gather: training is unchanged
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    per_sample_loss("mlp", oracle(x), y).mean().backward()
    for name, param in model.named_parameters():
        what = f"after the refused set_symm_mem_for_comm(): {name} sharded gradient"
        assert_sharded_grad(ctx, what, param, oracle.get_parameter(name).grad)
    step_and_compare(ctx, model, oracle, opts, 0)


class Injected(Exception):
    """The error a check injects into a forward (caught by the check)."""


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    world_sizes=(1, 2),
)
def reset_after_failed_standalone_call(ctx):
    """P76: ``TrunkTail`` (P63: ``fully_shard(inp)``, the group ``fully_shard([a, b])`` whose ``b``
    never runs, ``fully_shard(tail)`` and the root); one SGD step; then ``model.inp(x)`` called on
    its own raises inside ``inp``'s forward (caught); ``model.reset_iter_state()``; in the next step the group is SHARDED right
    after the root's forward, and losses, sharded gradients and the values after the SGD step
    equal the unsharded model's."""
    ctx.seed(0)
    model = TrunkTail().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model.inp, mesh=ctx.mesh)  # runs first in the root's forward
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model.tail, mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step, 7)
        if step == 1:

            def fail_once(*args, **kwargs):  # inp's body: FSDP's pre-forward ran for it
                del model.inp.forward  # the class's forward again from now on
                raise Injected("injected in inp's forward")

            model.inp.forward = fail_once
            try:
                model.inp(torch.zeros(B, 5, device=ctx.device))
            except Injected:
                pass
            else:
                raise AssertionError(f"{ctx.where()} setup: the injected error did not propagate")
            model.reset_iter_state()
        out = model(x[mine])
        _assert_group_sharded(ctx, model, f"after the root's forward of step {step}")
        backward_and_compare(ctx, model, oracle, (out, oracle(x), y, mine), (opt, oopt), step)


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING, base.HSDP_ALL_REDUCE},
    world_sizes=(1, 2),
)
def all_reduce_hook_stream_1d(ctx):
    """P77: on a 1-D mesh, ``model.out.set_all_reduce_hook(hook, stream=s)`` with ``s`` a fresh
    stream of the device's module (``torch.get_device_module(device).Stream()``): in each of two
    backwards ``hook`` runs once, with ``s`` the current stream while it runs, and the current
    stream is the previous one again after the backward; gradients and values after each SGD
    step equal the unsharded model's (the hook only observes)."""
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    device_module = torch.get_device_module(ctx.device)
    stream = device_module.Stream()
    seen = []
    model.out.set_all_reduce_hook(
        lambda reduced: seen.append(device_module.current_stream() == stream), stream=stream
    )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        seen.clear()
        before = device_module.current_stream()
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        assert seen == [True], (
            f"{ctx.where()} step {step}: the all-reduce hook ran {len(seen)} time(s), on the "
            f"given stream: {seen}; expected once, on the stream passed to set_all_reduce_hook"
        )
        assert device_module.current_stream() == before, (
            f"{ctx.where()} step {step}: the current stream changed across the backward"
        )
        for name, param in model.named_parameters():
            expected = chunk_of(
                oracle.get_parameter(name).grad, shard_dim(param), ctx.world_size, ctx.rank
            )
            assert_close(
                ctx,
                f"step {step}: {name} sharded gradient",
                param.grad.to_local(),
                expected,
                FP32["grad"],
            )
        step_and_compare(ctx, model, oracle, opts, step)


class TrunkHeads(nn.Module):
    """Trunk ``inp`` Linear(5, 7) -> tanh; heads ``a`` and ``b`` (Linear(7, 3) each) sharded as
    one group and called outside the root's forward (a chunked loss calling one head)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.a = nn.Linear(7, 3)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return torch.tanh(self.inp(x))


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    world_sizes=(1, 2),
)
def partial_group_backward(ctx):
    """P78: ``fully_shard([m.a, m.b])`` and the root over ``TrunkHeads``; each step computes
    ``m.a(m(x))`` (the group's forward runs ``a`` only, outside the root's forward): over two SGD
    steps the loss, the sharded gradients (chunks of the unsharded model's; ``b``'s None) and the
    values after each step equal the unsharded model's, and after each backward every parameter
    is SHARDED (a DTensor)."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    model = TrunkHeads().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step, 3)
        out, oout = model.a(model(x[mine])), oracle.a(oracle(x))
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), (
                f"{ctx.where()} step {step}: {name} is registered as {type(param).__name__} after "
                "the step; the group should be SHARDED after its backward"
            )


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.HSDP},
    world_sizes=(2, 4),
)
def hsdp_extension_shard_mesh(ctx):
    """P16, P14: on an HSDP mesh ``("replicate", "shard")`` of shape (ws/2, 2), a parameter whose
    tensor subclass implements ``fsdp_pre_all_gather`` (``Pair5``) gets the shard sub-mesh in
    that hook: 1-D, named ``("shard",)``, of size 2 (a shard size of 1 takes upstream's
    no-all-gather path, which hands a two-input extension one output: left out); the forward computes with the original
    values."""
    shard = 2
    mesh = ctx.make_mesh((ctx.world_size // shard, shard), ("replicate", "shard"))
    rows = 2 * ctx.world_size
    module = PairLinear(rows, _subclasses.Pair5).to(ctx.device)
    original = distinct_values((rows, 3), 0) / 100.0
    ctx.impl.ns.fully_shard(module, mesh=mesh)
    x = (distinct_values((2, 3), 4) / 100.0).to(ctx.device)
    _subclasses.LOG.clear()
    try:
        with torch.no_grad():
            out = module(x).cpu()
        meshes = [e["mesh"] for e in _subclasses.LOG if e["hook"].startswith("pre")]
    finally:
        _subclasses.LOG.clear()
    assert len(meshes) == 1, f"{ctx.where()} pre hook ran {len(meshes)} time(s), expected once"
    got = (meshes[0].ndim, tuple(meshes[0].mesh_dim_names or ()), meshes[0].size())
    assert got == (1, ("shard",), shard), (
        f"{ctx.where()} pre hook got a mesh (ndim, names, size) {got}; expected the shard "
        f"sub-mesh (1, ('shard',), {shard})"
    )
    assert torch.equal(out, x.cpu() @ original.T), (
        f"{ctx.where()} forward output differs from the original weight's"
    )
