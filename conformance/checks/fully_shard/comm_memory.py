"""Area "training": where a unit's communication buffers come from: the process group's own
allocator, symmetric memory or a custom comm, one at a time (P75, P101), and which units
``set_reduce_scatter_max_input_buffers`` reaches (P73).

[Note: one allocation strategy per unit]
A unit's all-gather buffers come from one place: the default allocator, the process group's own
allocator (``set_allocate_memory_from_process_group_for_comm(True)``), symmetric memory
(``set_symm_mem_for_comm()``) or a custom comm. Once the process-group allocator is on,
``set_symm_mem_for_comm()`` refuses the unit with AssertionError naming the all-gather comm in
place (``ProcessGroupAllocAllGather``); turned off again (``False``), the unit is back on the
default all-gather and that refusal is gone. Symmetric memory's only allocation backend is NCCL:
where torch has no NCCL (a CPU build) the setup itself then fails with RuntimeError naming NCCL
and the unit keeps its default all-gather, so training afterwards is unchanged; with NCCL any
outcome but that AssertionError is accepted (symmetric memory depends on the machine). A unit
with a custom reduce-scatter likewise refuses the process group's allocator (P101).

[Note: seeing where the reduce-scatter buffer cap was set]
The cap changes no value (P73), but a unit whose reduce-scatter is the symmetric-memory comm
refuses a cap above 1 at its lazy init (the root's first forward) with ValueError
"set_reduce_scatter_max_input_buffers(>1) is not supported with the symmetric-memory
reduce-scatter comm ..." naming the unit: the symmetric-memory pool reuses one buffer, so it cannot
retain several. That refusal shows which units the setter reached. Symmetric memory itself needs
NCCL, so the comm given to the child here derives from the namespace's ``SymmMemReduceScatter``
with its setup skipped: ``torch.empty`` staging buffers and ``torch.distributed``'s own
reduce-scatter (a custom comm, P39), hence the values are the default comm's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    assert_sharded_grad,
    make_batch,
    make_optimizer,
    per_sample_loss,
    shard_dim,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.custom_comms import CountingReduceScatter
from conformance.checks.fully_shard.edges import Pair
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


REFUSAL = "set_reduce_scatter_max_input_buffers(>1) is not supported with the symmetric-memory"


def _symm_mem_reduce_scatter(ctx):
    """A reduce-scatter comm of the symmetric-memory kind with its setup skipped (module Note)."""
    collectives = ns_module(ctx, "_fully_shard._fsdp_collectives")

    class SkippedSetup(collectives.SymmMemReduceScatter):
        def __init__(self):  # no symmetric-memory backend or rendezvous: NCCL only
            pass

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    return SkippedSetup()


@check(
    area="training",
    requires={
        base.TRAINING,
        base.DTENSOR_PARAMS,
        base.FSDP2_API,
        base.FSDP2_CUSTOM_COMMS,
        base.FSDP2_SYMM_MEM,
    },
    world_sizes=(1, 2),
)
def max_input_buffers_recurse(ctx):
    """P73: on ``Sequential(Linear, Tanh, Linear)`` with ``fully_shard(m[0])`` (its reduce-scatter a
    symmetric-memory comm, module Note) and the root: ``m.set_reduce_scatter_max_input_buffers(2)``
    (recursive by default) reaches ``m[0]``, whose group refuses it at the first forward
    (ValueError naming module '0'); ``m.set_reduce_scatter_max_input_buffers(2, recurse=False)``
    sets the root only, so the forward runs and a backward and SGD step equal the unsharded
    model's; ``m[0].set_reduce_scatter_max_input_buffers(2, recurse=False)`` sets ``m[0]`` itself
    (refused again)."""
    ws, rank = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(94)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    mine = slice(rank * B, (rank + 1) * B)

    def build():
        ctx.seed(0)
        oracle = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
        model = copy.deepcopy(oracle)
        ctx.impl.ns.fully_shard(model[0], mesh=ctx.mesh)
        ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
        model[0].set_custom_reduce_scatter(_symm_mem_reduce_scatter(ctx))
        return model, oracle

    for what, set_cap in (
        (
            "m.set_reduce_scatter_max_input_buffers(2)",
            lambda m: m.set_reduce_scatter_max_input_buffers(2),
        ),
        (
            "m[0].set_reduce_scatter_max_input_buffers(2, recurse=False)",
            lambda m: m[0].set_reduce_scatter_max_input_buffers(2, recurse=False),
        ),
    ):
        model, _ = build()
        set_cap(model)
        try:
            model(x[mine])
        except ValueError as exc:
            assert REFUSAL in str(exc) and "'0'" in str(exc), (
                f"{ctx.where()} {what}: ValueError {str(exc)[:300]!r} is not the "
                f"symmetric-memory refusal ({REFUSAL!r}) naming module '0'"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} {what}, then a forward: no ValueError; m[0] (symmetric-memory "
                "reduce-scatter) should hold the cap 2 and refuse it at its lazy init"
            )

    model, oracle = build()
    model.set_reduce_scatter_max_input_buffers(2, recurse=False)
    try:
        out = model(x[mine])
    except ValueError as exc:
        raise AssertionError(
            f"{ctx.where()} m.set_reduce_scatter_max_input_buffers(2, recurse=False) reached "
            f"m[0]: the forward raised {str(exc)[:300]!r}; recurse=False sets the root only"
        ) from exc
    out.square().mean().backward()
    oracle(x).square().reshape(ws, -1).mean(1).mean().backward()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"after set_reduce_scatter_max_input_buffers(2, recurse=False): {fqn} sharded gradient",
            param.grad.to_local(),
            chunk_of(oracle.get_parameter(fqn).grad, shard_dim(param), ws, rank),
            FP32["grad"],
        )
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    step_and_compare(ctx, model, oracle, opts, 0)


@check(
    area="training",
    requires={base.FSDP2_API, base.TRAINING, base.FSDP2_CUSTOM_COMMS},
    world_sizes=(2,),
)
def custom_reduce_scatter_excludes_pg_allocator(ctx):
    """P101: a unit with a custom reduce-scatter (``set_custom_reduce_scatter(comm)``) refuses
    ``set_allocate_memory_from_process_group_for_comm(True)``: AssertionError "cannot call
    set_allocate_memory_from_process_group() when reduce scatter comm is custom: <comm's class>";
    the custom reduce-scatter stays in use (a backward calls it)."""
    ctx.seed(0)
    model = Pair().to(ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.make_mesh((ctx.world_size,)))
    comm = CountingReduceScatter()
    model.set_custom_reduce_scatter(comm)
    expect_error(
        ctx,
        "set_allocate_memory_from_process_group_for_comm(True) after set_custom_reduce_scatter",
        AssertionError,
        r"cannot call set_allocate_memory_from_process_group\(\) when reduce scatter comm is "
        r"custom: CountingReduceScatter",
        lambda: model.set_allocate_memory_from_process_group_for_comm(True),
    )
    model(torch.ones(B, 4, device=ctx.device)).sum().backward()
    assert comm.calls > 0, f"{ctx.where()} the custom reduce-scatter was not used after the refusal"
