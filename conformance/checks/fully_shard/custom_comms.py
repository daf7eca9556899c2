"""Area "training": ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (P39).

[Note: a custom collective]
Upstream's ``Comm`` protocol: an object with ``allocate(size, *, dtype, device)`` (the staging
buffer) and ``__call__(output, input, group, [op,] async_op=False)`` (the collective itself,
returning a ``Work`` or None). After ``unit.set_custom_all_gather(comm)`` every all-gather of that
unit goes through ``comm``; after ``set_custom_reduce_scatter(comm)`` every reduce-scatter. The
comms below do the collective with ``torch.distributed``'s own functions and count their calls, so
the check proves they were used (one all-gather call per unshard of the unit, one reduce-scatter
call per backward) and that the values are unchanged (training equals the oracle). At world
size 1 nothing is communicated, so the check starts at 2.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    MLP,
    PLANS,
    B,
    assert_sharded_grad,
    make_batch,
    make_optimizer,
    per_sample_loss,
    step_and_compare,
)
from conformance.registry import check

REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_CUSTOM_COMMS}


class CountingAllGather:
    """An all-gather ``Comm``: ``torch.empty`` buffers, ``all_gather_into_tensor``, counted."""

    def __init__(self):
        self.calls = 0
        self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)


class CountingReduceScatter:
    """A reduce-scatter ``Comm``: ``torch.empty`` buffers, ``reduce_scatter_tensor``, counted."""

    def __init__(self):
        self.calls = 0
        self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


@check(
    area="training",
    requires=REQUIRES,
    cases={"all-gather": {"kind": "all_gather"}, "reduce-scatter": {"kind": "reduce_scatter"}},
    min_world_size=2,
)
def custom_comm_used(ctx, kind):
    """P39: ``model.inp.set_custom_all_gather(comm)`` (resp. ``set_custom_reduce_scatter``) on
    the nested MLP: over two SGD steps ``comm`` is called for ``inp``'s all-gathers (at least
    once per forward; twice per step as ``inp`` reshards after forward and gathers again in
    backward), resp. exactly once per backward for ``inp``'s reduce-scatter, never for the other
    units; the gradients and parameters equal the oracle's."""
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    plan = [("inp", {"reshard_after_forward": True}), ("out", {}), ("", {})]
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    if kind == "all_gather":
        comm = CountingAllGather()
        model.inp.set_custom_all_gather(comm)
    else:
        comm = CountingReduceScatter()
        model.inp.set_custom_reduce_scatter(comm)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        before = comm.calls
        loss = per_sample_loss("mlp", model(x[mine]), y[mine]).mean()
        in_forward = comm.calls - before
        loss.backward()
        in_backward = comm.calls - before - in_forward
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        if kind == "all_gather":
            assert in_forward == 1 and in_backward == 1, (
                f"{ctx.where()} step {step}: the custom all-gather was called {in_forward} "
                f"time(s) in forward and {in_backward} in backward; expected 1 and 1 (inp's "
                "unshard in forward and again in backward, reshard_after_forward=True)"
            )
        else:
            assert (in_forward, in_backward) == (0, 1), (
                f"{ctx.where()} step {step}: the custom reduce-scatter was called {in_forward} "
                f"time(s) in forward and {in_backward} in backward; expected 0 and 1 (inp's "
                "one reduce-scatter)"
            )
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx,
                f"step {step}: {name} sharded gradient with a custom {kind}",
                param,
                oracle.get_parameter(name).grad,
            )
        step_and_compare(ctx, model, oracle, opts, step)
    assert comm.allocations >= comm.calls > 0, (
        f"{ctx.where()} the custom {kind} allocated {comm.allocations} buffer(s) for "
        f"{comm.calls} call(s); expected its allocate() to provide the buffers"
    )


@check(area="training", requires=REQUIRES, world_sizes=(1, 2))
def custom_comm_excludes_pg_allocator(ctx):
    """P39, P31: a unit with a custom all-gather refuses
    ``set_allocate_memory_from_process_group_for_comm(True)`` (the custom comm decides its own
    buffers): AssertionError naming ``set_allocate_memory_from_process_group``."""
    ctx.seed(0)
    model = ctx.impl.shard(MLP().to(ctx.device), ctx, plan=PLANS["nested"])
    model.inp.set_custom_all_gather(CountingAllGather())
    try:
        model.inp.set_allocate_memory_from_process_group_for_comm(True)
    except AssertionError as exc:
        assert "set_allocate_memory_from_process_group" in str(exc), (
            f"{ctx.where()} AssertionError {exc!r} does not name "
            "set_allocate_memory_from_process_group"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} set_allocate_memory_from_process_group_for_comm(True) after "
            "set_custom_all_gather raised nothing"
        )
