"""Area "states": what a ``fully_shard`` module has registered, and what it keeps allocated, at each
point of an iteration (P2, P4, P18 of the spec).

[Note: the states of a parameter]
SHARDED: the module attribute is an ``nn.Parameter`` wrapping a DTensor with the original global
    size, placement ``(Shard(0),)`` on the 1-D mesh, local = ``torch.chunk(p, ws, 0)[rank]``.
    The unsharded tensor's storage is freed (resized to 0 bytes).
UNSHARDED: the module attribute is a plain ``nn.Parameter`` (not a DTensor) with the full values;
    its storage is allocated. It is the same Parameter object every time (created once, reused).
SHARDED_POST_FORWARD (``reshard_after_forward=k``, 1 < k < ws, k | ws): the registered DTensor
    lives on a 2-D mesh ``mesh.view(-1, k)`` with ``(Replicate(), Shard(0))``; this rank holds
    ``torch.chunk(p, k, 0)[rank % k]``.
After forward: ``reshard_after_forward`` True -> SHARDED (root too), False -> UNSHARDED,
    None -> root UNSHARDED, every other module SHARDED; int k -> SHARDED_POST_FORWARD; k == ws
    -> like True; k == 1 -> like False (with a warning). After backward every parameter is SHARDED.
``reshard()`` forces SHARDED; ``unshard()`` / ``unshard(async_op=True).wait()`` give UNSHARDED.
The unsharded parameter each module sees is captured inside its ``forward`` (the only portable
place where it is registered, whatever the state afterwards).
A forward under ``torch.no_grad()`` follows the same rules (nothing reshards the units it left
UNSHARDED until ``reshard()`` or the next backward), so an optimizer built right after it holds
whatever is registered then.

This module checks the states after forward, backward and ``reshard()`` (1-D and HSDP meshes) and
holds the model and the state assertions; ``unsharded_param.py`` checks the unsharded Parameter
object itself: ``unshard()`` on demand, its reuse across iterations, and what an optimizer built
after a ``no_grad`` forward holds (``optimizer_after_no_grad_forward``).

[Note: a reset between a forward and its backward]
``reset_iter_state()`` on the root forgets the iteration in flight, not only a failed one: called
between a forward and its backward, every parameter is SHARDED again and that backward still
runs, each unit's pre-backward all-gathering what it needs (P37), with the unsharded model's
gradients. It also forgets the forward's order, so the backward after it, or the next
iteration's, prefetches by the new forward's order only (P86): for the nested MLP (units ``inp``
and ``out``, a root without parameters) every backward all-gathers ``out``, then ``inp``, once
each, as a plain iteration's does, never a unit of the forgotten forward again. Each all-gather
is known by its output size (``prefetch.gathered_numel``: 32 for ``out``, 48 for ``inp`` at world
sizes 2 and 4); at world size 1 nothing is gathered, so only the values are compared there.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
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
from conformance.checks._shared.rows import chunk_range
from conformance.checks.fully_shard.prefetch import GatherSpy, gathered_numel
from conformance.registry import check


class RecordingLinear(nn.Module):
    """A Linear that records the parameter objects it computes with (the unsharded ones)."""

    def __init__(self, fan_in: int, fan_out: int, salt: int):
        super().__init__()
        self.weight = nn.Parameter(distinct_values((fan_out, fan_in), salt) / 1000.0)
        self.bias = nn.Parameter(distinct_values((fan_out,), salt + 1) / 1000.0)
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        self.seen.append({"weight": self.weight, "bias": self.bias})
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    """Root with its own parameter ``scale`` and two children (one with dims below the world size).

    lin1.weight (10, 4): uneven for ws 3/4; lin2.weight (3, 10): rank 3 of 4 holds no rows.
    ``even=True``: every dim 0 is a multiple of 4 (no padding at any world size <= 4 but 3)."""

    def __init__(self, even: bool = False):
        super().__init__()
        hidden, out = (8, 4) if even else (10, 3)
        self.lin1 = RecordingLinear(4, hidden, 0)
        self.lin2 = RecordingLinear(hidden, out, 2)
        self.scale = nn.Parameter(distinct_values((out,), 4) / 1000.0)
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        self.seen.append({"scale": self.scale})
        return self.lin2(torch.tanh(self.lin1(x))) * self.scale


UNITS = ("lin1", "lin2", "")  # children first, root last
PLAN = [(fqn, {}) for fqn in UNITS]


def unsharded_net(ctx, even=False) -> nn.Module:
    """The ``Net`` that :func:`build` shards (same seed), unsharded."""
    ctx.seed(0)
    return Net(even).to(ctx.device)


def build(ctx, even=False, **options):
    model = unsharded_net(ctx, even)
    originals = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    model = ctx.impl.shard(model, ctx, plan=PLAN, **options)
    return model, originals


def own_params(model, unit: str):
    """(clean FQN, name on the module, module) of the parameters ``unit`` manages itself."""
    module = model.get_submodule(unit)
    prefix = f"{unit}." if unit else ""
    return [(prefix + name, name, module) for name, _ in module.named_parameters(recurse=False)]


def assert_sharded(ctx, fqn, param, orig, where=""):
    """SHARDED: a DTensor Parameter, (Shard(0),) on the 1-D mesh, local rows of torch.chunk."""
    from torch.distributed.tensor import DTensor, Shard

    tag = f"{ctx.where()} {fqn}{where}"
    assert isinstance(param, nn.Parameter), (
        f"{tag}: registered {type(param).__name__}, not a Parameter"
    )
    assert isinstance(param, DTensor), f"{tag}: expected SHARDED (a DTensor), got a plain tensor"
    assert tuple(param.placements) == (Shard(0),), (
        f"{tag}: placements {param.placements} != (Shard(0),)"
    )
    assert param.device_mesh.ndim == 1 and param.device_mesh.size() == ctx.world_size, (
        f"{tag}: mesh {param.device_mesh}, expected the 1-D mesh of {ctx.world_size} ranks"
    )
    assert tuple(param.shape) == tuple(orig.shape), f"{tag}: global size {tuple(param.shape)}"
    start, end = chunk_range(orig.shape[0], ctx.world_size, ctx.rank)
    local = param.to_local().detach().cpu()
    assert torch.equal(local, orig[start:end]), (
        f"{tag}: local shard {tuple(local.shape)} is not rows {start}:{end} of the original"
    )


def assert_unsharded(ctx, fqn, param, orig, where=""):
    """UNSHARDED: a plain Parameter holding the full values in allocated storage."""
    from torch.distributed.tensor import DTensor

    tag = f"{ctx.where()} {fqn}{where}"
    assert isinstance(param, nn.Parameter), (
        f"{tag}: registered {type(param).__name__}, not a Parameter"
    )
    assert not isinstance(param, DTensor), (
        f"{tag}: expected UNSHARDED (plain tensor), got a DTensor"
    )
    assert tuple(param.shape) == tuple(orig.shape), (
        f"{tag}: size {tuple(param.shape)} != {tuple(orig.shape)}"
    )
    assert param.untyped_storage().nbytes() >= orig.numel() * orig.element_size(), (
        f"{tag}: unsharded storage has {param.untyped_storage().nbytes()} bytes, expected at least "
        f"{orig.numel() * orig.element_size()}"
    )
    assert torch.equal(param.detach().cpu(), orig), (
        f"{tag}: unsharded values differ from the original"
    )


def assert_post_forward(ctx, fqn, param, orig, k):
    """SHARDED_POST_FORWARD over groups of k ranks: (Replicate(), Shard(0)) on mesh.view(-1, k)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tag = f"{ctx.where()} {fqn} after forward with reshard_after_forward={k}"
    assert isinstance(param, DTensor), f"{tag}: expected a DTensor, got {type(param).__name__}"
    assert tuple(param.placements) == (Replicate(), Shard(0)), (
        f"{tag}: placements {param.placements} != (Replicate(), Shard(0))"
    )
    mesh = param.device_mesh.mesh.tolist()
    expected = torch.arange(ctx.world_size).view(-1, k).tolist()
    assert mesh == expected, f"{tag}: post-forward mesh {mesh}, expected {expected}"
    start, end = chunk_range(orig.shape[0], k, ctx.rank % k)
    local = param.to_local().detach().cpu()
    assert torch.equal(local, orig[start:end]), (
        f"{tag}: local {tuple(local.shape)} is not rows {start}:{end} (chunk {ctx.rank % k} of {k})"
    )


def assert_freed(ctx, fqn, tensor, where):
    nbytes = tensor.untyped_storage().nbytes()
    assert nbytes == 0, (
        f"{ctx.where()} {fqn}: the unsharded parameter's storage has {nbytes} bytes {where}, "
        f"expected 0 (freed)"
    )


def last_seen(model, fqn):
    unit, _, name = fqn.rpartition(".")
    return model.get_submodule(unit).seen[-1][name]


def batch(ctx):
    return distinct_values((2, 4), 7).to(ctx.device) / 100.0


def build_case(ctx, name):
    """The model of case ``name`` sharded with its reshard_after_forward; returns (model, originals, raf)."""
    spec = RAF_CASES[name]
    raf = spec["raf"](ctx.world_size)
    model, originals = build(ctx, even=spec.get("even", False), reshard_after_forward=raf)
    return model, originals, raf


# reshard_after_forward cases: value (a function of ws) and the expected state per unit after forward
RAF_CASES = {
    "true": {"raf": lambda ws: True, "expect": {"lin1": "S", "lin2": "S", "": "S"}},
    "false": {"raf": lambda ws: False, "expect": {"lin1": "U", "lin2": "U", "": "U"}},
    "none": {"raf": lambda ws: None, "expect": {"lin1": "S", "lin2": "S", "": "U"}},
    "int-1": {"raf": lambda ws: 1, "expect": {"lin1": "U", "lin2": "U", "": "U"}},
    "int-ws": {"raf": lambda ws: ws, "expect": {"lin1": "S", "lin2": "S", "": "S"}, "min_ws": 2},
    "int-half": {"raf": lambda ws: ws // 2, "expect": {"lin1": "P", "lin2": "P", "": "P"}, "ws": 4},
    # the same with dims divisible by the world size (no padding inside the all-gather output)
    "int-half-even": {
        "raf": lambda ws: ws // 2,
        "expect": {"lin1": "P", "lin2": "P", "": "P"},
        "ws": 4,
        "even": True,
    },
}


def raf_check(names, requires):
    """Register a check once per applicable world-size class of its reshard_after_forward cases."""

    def register(fn):
        plain = {
            n: {"name": n}
            for n in names
            if "ws" not in RAF_CASES[n] and "min_ws" not in RAF_CASES[n]
        }
        fn = check(area="states", requires=requires, cases=plain)(fn)
        for n in names:
            spec = RAF_CASES[n]
            if "ws" in spec:
                fn = check(
                    area="states",
                    requires=requires,
                    cases={n: {"name": n}},
                    world_sizes=(spec["ws"],),
                )(fn)
            elif "min_ws" in spec:
                fn = check(
                    area="states",
                    requires=requires,
                    cases={n: {"name": n}},
                    min_world_size=spec["min_ws"],
                )(fn)
        return fn

    return register


def _check_after_forward(ctx, model, originals, expect, raf):
    for unit in UNITS:
        for fqn, name, module in own_params(model, unit):
            param, orig, state = getattr(module, name), originals[fqn], expect[unit]
            if state == "S":
                assert_sharded(
                    ctx, fqn, param, orig, f" after forward (reshard_after_forward={raf})"
                )
                assert_freed(ctx, fqn, last_seen(model, fqn), f"after forward (raf={raf})")
            elif state == "U":
                assert_unsharded(
                    ctx, fqn, param, orig, f" after forward (reshard_after_forward={raf})"
                )
                assert param is last_seen(model, fqn), (
                    f"{ctx.where()} {fqn}: the registered parameter after forward is not the object "
                    f"forward computed with"
                )
            else:
                assert_post_forward(ctx, fqn, param, orig, raf)
                assert_freed(ctx, fqn, last_seen(model, fqn), f"after forward (raf={raf})")


_ALL = tuple(RAF_CASES)


@raf_check(_ALL, {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS})
def registered_after_forward(ctx, name):
    """After forward each unit's registered parameters are in the state its reshard_after_forward
    implies (True/k==ws: SHARDED, root included; False/k==1: UNSHARDED, the very object forward used;
    None: root UNSHARDED, others SHARDED; 1<k<ws: SHARDED_POST_FORWARD), and resharded storage is
    freed (P2, P4)."""
    model, originals, raf = build_case(ctx, name)
    with torch.no_grad():
        model(batch(ctx))
    _check_after_forward(ctx, model, originals, RAF_CASES[name]["expect"], raf)


@raf_check(_ALL, {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS})
def registered_after_backward(ctx, name):
    """After backward every parameter is SHARDED (DTensor, Shard(0), original values) whatever
    reshard_after_forward was, with the unsharded storage freed and a sharded gradient present
    (P2, P4)."""
    from torch.distributed.tensor import DTensor

    model, originals, raf = build_case(ctx, name)
    model(batch(ctx)).sum().backward()
    for fqn, param in model.named_parameters():
        assert_sharded(ctx, fqn, param, originals[fqn], f" after backward (raf={raf})")
        assert_freed(ctx, fqn, last_seen(model, fqn), f"after backward (raf={raf})")
        assert isinstance(param.grad, DTensor), (
            f"{ctx.where()} {fqn}: grad after backward is {type(param.grad).__name__}, expected a DTensor"
        )
        assert tuple(param.grad.placements) == tuple(param.placements), (
            f"{ctx.where()} {fqn}: grad placements {param.grad.placements} != {param.placements}"
        )


@raf_check(
    ("false", "none", "int-half", "int-half-even"),
    {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS},
)
def reshard_forces_sharded(ctx, name):
    """``reshard()`` on every unit after a forward that left parameters unsharded (or sharded
    post-forward) registers SHARDED DTensors again and frees the unsharded storage (P2, P4)."""
    model, originals, raf = build_case(ctx, name)
    with torch.no_grad():
        model(batch(ctx))
    for unit in UNITS:
        model.get_submodule(unit).reshard()
    for fqn, param in model.named_parameters():
        assert_sharded(ctx, fqn, param, originals[fqn], f" after reshard() (raf={raf})")
        assert_freed(ctx, fqn, last_seen(model, fqn), "after reshard()")


@check(area="states", requires={base.FSDP2_API, base.DTENSOR_PARAMS})
def full_tensor_equals_original(ctx):
    """Before any forward, every registered parameter's ``full_tensor()`` equals the original."""
    model, originals = build(ctx)
    for fqn, param in model.named_parameters():
        full = param.full_tensor().detach().cpu()
        assert torch.equal(full, originals[fqn]), (
            f"{ctx.where()} {fqn}: full_tensor() differs from the original"
        )


def assert_hsdp_sharded(ctx, fqn, param, orig, where):
    """HSDP SHARDED: (Replicate(), Shard(0)) on the (2, 2) mesh, chunk rank % 2 of 2 locally."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tag = f"{ctx.where()} {fqn} {where}"
    assert isinstance(param, DTensor), f"{tag}: expected SHARDED (a DTensor), got a plain tensor"
    assert tuple(param.placements) == (Replicate(), Shard(0)), (
        f"{tag}: placements {param.placements}"
    )
    start, end = chunk_range(orig.shape[0], 2, ctx.rank % 2)
    assert torch.equal(param.to_local().detach().cpu(), orig[start:end]), (
        f"{tag}: local shard is not rows {start}:{end} (chunk {ctx.rank % 2} of 2)"
    )


@check(
    area="states",
    requires={base.FSDP2_API, base.HSDP, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS},
    cases={"true": {"raf": True}, "false": {"raf": False}},
    world_sizes=(4,),
)
def hsdp_states(ctx, raf):
    """On a (replicate=2, shard=2) mesh: SHARDED is (Replicate(), Shard(0)) with chunk rank % 2;
    after forward the parameters are SHARDED (raf=True, storage freed) or UNSHARDED (raf=False,
    the object forward used); after backward SHARDED with gradients of the same placements."""
    mesh = ctx.make_mesh((2, 2), ("replicate", "shard"))
    model, originals = build(ctx, mesh=mesh, reshard_after_forward=raf)
    for fqn, param in model.named_parameters():
        assert_hsdp_sharded(ctx, fqn, param, originals[fqn], "after fully_shard")
    out = model(batch(ctx))
    for fqn, param in model.named_parameters():
        if raf:
            assert_hsdp_sharded(ctx, fqn, param, originals[fqn], "after forward (raf=True)")
            assert_freed(ctx, fqn, last_seen(model, fqn), "after forward (raf=True)")
        else:
            assert_unsharded(ctx, fqn, param, originals[fqn], " after forward (raf=False)")
            assert param is last_seen(model, fqn), (
                f"{ctx.where()} {fqn}: not the object forward used"
            )
    out.sum().backward()
    for fqn, param in model.named_parameters():
        assert_hsdp_sharded(ctx, fqn, param, originals[fqn], "after backward")
        assert tuple(param.grad.placements) == tuple(param.placements), (
            f"{ctx.where()} {fqn}: grad placements {param.grad.placements}"
        )


def assert_backward_gathers(ctx, oracle, sizes, what):
    """The nested MLP's backward all-gathered ``out``, then ``inp``, once each (module Note)."""
    if ctx.world_size == 1:
        return  # nothing to gather
    names = {gathered_numel(getattr(oracle, u), ctx.world_size): u for u in ("out", "inp")}
    got = [names.get(n, f"<{n} elements>") for n in sizes]
    assert got == ["out", "inp"], (
        f"{ctx.where()} {what}: backward all-gathered {got}, expected out, then inp, once each "
        "(as a plain iteration's backward)"
    )


@check(
    area="states",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    cases={"pending-backward": {"pending": True}, "forward-only": {"pending": False}},
)
def reset_iter_state_between_forward_and_backward(ctx, pending):
    """P113: nested MLP; ``loss = <forward>``, ``model.reset_iter_state()``, then every parameter
    is SHARDED; pending-backward: ``loss.backward()`` still runs, then an SGD step; forward-only:
    the loss is dropped. Then two SGD steps of new iterations. Each backward all-gathers out,
    then inp, once each (ws >= 2), the sharded gradients are the oracle's chunks and the
    parameters after each step the oracle's."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    loss = per_sample_loss("mlp", model(x[mine]), y[mine]).mean()
    model.reset_iter_state()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {name}: registered {type(param).__name__} after reset_iter_state() "
            "between forward and backward, expected the sharded DTensor"
        )
    steps = ("reset", 1, 2) if pending else (1, 2)
    for step in steps:
        if step != "reset":
            x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
            loss = per_sample_loss("mlp", model(x[mine]), y[mine]).mean()
        with GatherSpy() as spy:
            loss.backward()
        what = "the backward begun before reset_iter_state()" if step == "reset" else (
            f"step {step} after reset_iter_state() between a forward and its backward"
        )  # fmt: skip
        assert_backward_gathers(ctx, oracle, spy.sizes, what)
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        for name, param in model.named_parameters():
            assert param.grad is not None, f"{ctx.where()} {what}: {name} has no gradient"
            assert_sharded_grad(
                ctx, f"{what}: {name} sharded gradient", param, oracle.get_parameter(name).grad
            )
        step_and_compare(ctx, model, oracle, opts, step)
