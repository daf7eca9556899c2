"""Area "training": explicit all-gather prefetching (P38) and the implicit backward prefetch
(P86).

[Note: observing the order of all-gathers]
``set_modules_to_forward_prefetch([m])`` on unit u issues m's all-gather right after u's own (in
u's pre-forward), before the units between them run; ``set_modules_to_backward_prefetch([m])``
does the same in u's pre-backward. So with three units ``l0, l1, l2`` (run in that order, each
resharded after forward) and ``l0`` prefetching ``l2`` the forward's all-gathers come in the order
l0, l2, l1 (without it: l0, l1, l2), and with ``l2`` prefetching ``l0`` in backward the backward's
come l2, l0, l1 (without it: l2, l1, l0). The spy records every all-gather op at the dispatcher
(``c10d`` / ``_c10d_functional``, any Python entry point; see ``_shared/collectives.py``) with its
output's element count, and each unit is known by that count: the sum over its parameters of
``ceil(d0/ws) * row * ws`` (the padded all-gather output, P4), distinct for the three units at every
world size from 2 to 4. At world size 1 there is nothing to gather, so the checks start at 2.

[Note: implicit backward prefetch]
Without ``set_modules_to_backward_prefetch`` a unit's pre-backward, right after its own all-gather,
issues the all-gather of the unit whose forward ran just before it, before the unit's own gradient
computation. For units l0, l1, l2 (Linear, run in that order, resharded after forward, under a
root without parameters) and an input without grad, backward runs l2 (all-gathered, then l1
prefetched), l2's two products (weight and input gradients), l1 (already gathered; l0
prefetched), l1's two products, then l0's one (its input needs no gradient): ``l2, l1, mm, mm,
l0, mm, mm, mm``. The spy records each all-gather by its output size (the Note above) and
each ``aten.mm`` as ``mm``; at world size 1 nothing is gathered, so the check starts at 2.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.adapters import base
from conformance.checks._shared.collectives import EventSpy, is_all_gather, output_numel
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    assert_sharded_grad,
    make_optimizer,
    shard_dim,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.AUTO_WRAP}
UNITS = ("l0", "l1", "l2")


class Chain(nn.Module):
    """Linear(4, 4) -> Linear(4, 8) -> Linear(8, 2), tanh between: three units whose padded
    all-gather sizes differ at ws 2, 3 and 4."""

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


def gathered_numel(module: nn.Module, ws: int) -> int:
    """A unit's all-gather output size by P1/P4: ``ceil(d0/ws) * row * ws`` per parameter."""
    total = 0
    for p in module.parameters():
        row = math.prod(p.shape[1:])
        total += -(-p.shape[0] // ws) * row * ws
    return total


class GatherSpy(TorchDispatchMode):
    """Records the output numel of every all-gather op (see the module Note)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if is_all_gather(name):
            self.sizes.append(output_numel(name, args, result))
        return result


def _build(ctx):
    ctx.seed(0)
    oracle = Chain().to(ctx.device)
    plan = [(u, {"reshard_after_forward": True}) for u in UNITS] + [("", {})]
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    sizes = {gathered_numel(getattr(oracle, u), ctx.world_size): u for u in UNITS}
    if len(sizes) != len(UNITS):
        raise AssertionError(f"{ctx.where()} setup: two units gather the same size {sizes}")
    return model, oracle, sizes


def _names(sizes, seen):
    return [sizes.get(n, f"<{n} elements>") for n in seen]


def _train_and_compare(ctx, model, oracle, steps, check_order):
    """``steps`` SGD steps on the global batch; ``check_order(step, forward, backward)`` gets the
    all-gather sizes of each phase; gradients and parameters equal the oracle's."""
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(steps):
        g = torch.Generator().manual_seed(70 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        with GatherSpy() as fwd:
            loss = model(x[mine]).square().mean()
        with GatherSpy() as bwd:
            loss.backward()
        oracle(x).square().reshape(ctx.world_size, -1).mean(1).mean().backward()
        check_order(step, fwd.sizes, bwd.sizes)
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx,
                f"step {step}: {name} sharded gradient with prefetching",
                param,
                oracle.get_parameter(name).grad,
            )
        step_and_compare(ctx, model, oracle, opts, step)


@check(area="training", requires=REQUIRES, min_world_size=2)
def forward_prefetch_order(ctx):
    """P38: ``model.l0.set_modules_to_forward_prefetch([model.l2])``: every forward all-gathers
    l0, then l2, then l1 (l2's gather issued from l0's pre-forward, ahead of l1's own); two SGD
    steps give the oracle's gradients and parameters."""
    model, oracle, sizes = _build(ctx)
    model.l0.set_modules_to_forward_prefetch([model.l2])

    def check_order(step, forward, backward):
        got = [n for n in _names(sizes, forward) if n in UNITS]
        assert got == ["l0", "l2", "l1"], (
            f"{ctx.where()} step {step}: forward all-gathers {_names(sizes, forward)}, expected "
            "l0, l2, l1 (l0 prefetches l2 right after its own all-gather)"
        )

    _train_and_compare(ctx, model, oracle, 2, check_order)


@check(area="training", requires=REQUIRES, min_world_size=2)
def backward_prefetch_order(ctx):
    """P38: ``model.l2.set_modules_to_backward_prefetch([model.l0])``: every backward
    all-gathers l2, then l0, then l1 (l0's gather issued from l2's pre-backward, ahead of l1's
    own); the gradients and parameters after two SGD steps equal the oracle's."""
    model, oracle, sizes = _build(ctx)
    model.l2.set_modules_to_backward_prefetch([model.l0])

    def check_order(step, forward, backward):
        got = [n for n in _names(sizes, backward) if n in UNITS]
        assert got == ["l2", "l0", "l1"], (
            f"{ctx.where()} step {step}: backward all-gathers {_names(sizes, backward)}, "
            "expected l2, l0, l1 (l2 prefetches l0 in its pre-backward)"
        )

    _train_and_compare(ctx, model, oracle, 2, check_order)


@check(area="training", requires={base.FSDP2_API, base.AUTO_WRAP}, world_sizes=(1, 2))
def prefetch_rejects_non_fsdp(ctx):
    """P38: ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` take FSDP
    modules only: a plain ``nn.Linear`` in the list raises ValueError "Expects FSDPModule but got
    <type>: ..."."""
    model = _build_plain(ctx)
    for method in ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"):
        try:
            getattr(model.l0, method)([nn.Linear(2, 2)])
        except ValueError as exc:
            assert "Expects FSDPModule" in str(exc), (
                f"{ctx.where()} {method}([Linear]): ValueError {exc!r} does not say "
                "'Expects FSDPModule'"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} {method}([nn.Linear]) raised nothing; expected ValueError "
                "'Expects FSDPModule but got ...'"
            )


def _build_plain(ctx):
    ctx.seed(0)
    plan = [(u, {}) for u in UNITS] + [("", {})]
    return ctx.impl.shard(Chain().to(ctx.device), ctx, plan=plan)


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
