"""Area "training": the reach of ``set_reduce_scatter_max_input_buffers``'s ``recurse`` (P73) and
FSDP2's implicit backward prefetch with one parameter group per unit (P86).

[Note: seeing where the reduce-scatter buffer cap was set]
The cap changes no value (P73), but a unit whose reduce-scatter is the symmetric-memory comm
refuses a cap above 1 at its lazy init (the root's first forward) with ValueError
"set_reduce_scatter_max_input_buffers(>1) is not supported with the symmetric-memory
reduce-scatter comm ..." naming the unit: the symmetric-memory pool reuses one buffer, so it cannot
retain several. That refusal shows which units the setter reached. Symmetric memory itself needs
NCCL, so the comm given to the child here derives from the namespace's ``SymmMemReduceScatter``
with its setup skipped: ``torch.empty`` staging buffers and ``torch.distributed``'s own
reduce-scatter (a custom comm, P39), hence the values are the default comm's.

[Note: implicit backward prefetch]
Without ``set_modules_to_backward_prefetch`` a unit's pre-backward, right after its own all-gather,
issues the all-gather of the unit whose forward ran just before it, before the unit's own gradient
computation. For units l0, l1, l2 (Linear, run in that order, resharded after forward, under a
root without parameters) and an input without grad, backward runs l2 (all-gathered, then l1
prefetched), l2's two products (weight and input gradients), l1 (already gathered; l0
prefetched), l1's two products, then l0's one (its input needs no gradient): ``l2, l1, mm, mm,
l0, mm, mm, mm``. The spy records each all-gather by its output size (``prefetch.py``'s Note) and
each ``aten.mm`` as ``mm``; at world size 1 nothing is gathered, so the check starts at 2.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.collectives import EventSpy
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    make_optimizer,
    shard_dim,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.prefetch import UNITS, Chain, gathered_numel
from conformance.registry import check

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


# A Linear's backward: one mm for the weight's gradient, one for the input's when it needs one.
BACKWARD_MM = {"l0": 1, "l1": 2, "l2": 2}


def _implicit_prefetch_events(forward_order) -> list[str]:
    """The module Note's schedule: in reverse forward order each unit is gathered (unless already
    prefetched), then the unit before it in forward is prefetched, then its products run."""
    events: list[str] = []
    backward_order = list(reversed(forward_order))
    for i, unit in enumerate(backward_order):
        if unit not in events:
            events.append(unit)
        if i + 1 < len(backward_order):
            events.append(backward_order[i + 1])
        events += ["mm"] * BACKWARD_MM[unit]
    return events


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.AUTO_WRAP},
    min_world_size=2,
)
def backward_prefetch_implicit(ctx):
    """P86: units l0, l1, l2 (``prefetch.py``'s Chain, each ``reshard_after_forward=True``) under a
    root without parameters, no ``set_modules_to_backward_prefetch``, an input without grad: in
    each of two backwards the all-gathers and matrix products come ``l2, l1, mm, mm, l0, mm, mm,
    mm`` (each unit's pre-backward prefetches the unit that ran before it in forward, before the
    unit's own products); the sharded gradients and the values after each SGD step equal the
    unsharded model's."""
    ctx.seed(0)
    oracle = Chain().to(ctx.device)
    plan = [(u, {"reshard_after_forward": True}) for u in UNITS] + [("", {})]
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    sizes = {gathered_numel(getattr(oracle, u), ctx.world_size): u for u in UNITS}
    assert len(sizes) == len(UNITS), f"{ctx.where()} setup: two units gather the same size {sizes}"
    expected = _implicit_prefetch_events(UNITS)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(80 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        loss = model(x[mine]).square().mean()
        with EventSpy(sizes) as spy:
            loss.backward()
        assert spy.events == expected, (
            f"{ctx.where()} step {step}: backward events {spy.events}, expected {expected} (each "
            "unit's pre-backward prefetches the unit that ran before it in forward, before its "
            "own products)"
        )
        oracle(x).square().reshape(ctx.world_size, -1).mean(1).mean().backward()
        for name, param in model.named_parameters():
            assert_close(
                ctx,
                f"step {step}: {name} sharded gradient with implicit prefetch",
                param.grad.to_local(),
                chunk_of(
                    oracle.get_parameter(name).grad, shard_dim(param), ctx.world_size, ctx.rank
                ),
                FP32["grad"],
            )
        step_and_compare(ctx, model, oracle, opts, step)
