"""Area "placement": where parameters live when ``shard_placement_fn`` picks the shard dim, on ranks
that hold nothing, on a 2-D (HSDP) mesh, and after ``load_state_dict(assign=True)`` (P1, P13, P16,
P116). Extends "layout".

[Note: the rules]
Shard(d): rank r holds ``torch.chunk(p, ws, d)[r]`` (``ceil(p.shape[d]/ws)`` entries per rank); the
    DTensor keeps the original global size and stride with placements ``(Shard(d),)``, and so does
    its gradient. ``Shard(-1)`` is normalised to ``Shard(ndim-1)``. A dim d != 0 must divide evenly
    (else NotImplementedError 'FSDP does not support uneven sharding on dim d'); ``Shard(d)`` with
    d >= ndim is an error ('Shard dim 1 is invalid for 1D tensor'); a non-Shard result such as
    ``Replicate()`` is ValueError 'Invalid shard_placement_fn result'.
Empty ranks: with dim 0 < ws, ranks past the last chunk hold a (0, *rest) local tensor, and still
    take part in forward/backward (their gradient is (0, *rest) too).
HSDP: on a ``(replicate, shard)`` mesh every parameter is ``(Replicate(), Shard(0))`` and rank r
    holds chunk ``r % shard_size`` over the shard dim; gradients are averaged over all ranks.
Assign-load: ``load_state_dict(..., assign=True)`` installs the loaded DTensor as the parameter;
    for a Shard(d != 0) parameter its local tensor must already be the rank's shard (a dim other
    than 0 is never re-padded), else AssertionError 'Shard(d) requires even sharding'.
Expected values come from an unsharded copy trained on the same inputs.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import ParamBag, distinct_values, expect_error
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check


class Lin(nn.Module):
    """y = x @ W.T + b with W (out, in); deterministic values."""

    def __init__(self, fan_in, fan_out, bias=True, salt=0):
        super().__init__()
        self.weight = nn.Parameter(distinct_values((fan_out, fan_in), salt) / 100.0)
        self.bias = nn.Parameter(distinct_values((fan_out,), salt + 1) / 100.0) if bias else None

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Two(nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.a = Lin(2 * ws, ws, salt=0)  # weight (ws, 2ws): dim 1 divisible by ws and largest
        self.b = Lin(ws, 3, salt=2)  # weight (3, ws), bias (3,): dim 0 uneven at ws 2 and 4

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _forward_recording(module, x):
    """``module(x)`` and the output of each direct child (a weight gathered into the wrong layout
    shows in its own module's output, while the loss's gradients may hardly depend on it)."""
    seen = {}
    hooks = [
        child.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
        for name, child in module.named_children()
    ]
    try:
        return module(x), seen
    finally:
        for hook in hooks:
            hook.remove()


def _grads_and_values(ctx, model, oracle, x, what):
    """Forward/backward both (same input on every rank, so the mean gradient is the local one):
    every child's output equals the oracle's, and each sharded gradient's local piece equals the
    oracle gradient's chunk."""
    from torch.distributed.tensor import DTensor, Shard

    out, seen = _forward_recording(model, x)
    oracle_out, oracle_seen = _forward_recording(oracle, x)
    for name, expected in oracle_seen.items():
        assert torch.allclose(
            seen[name].detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=0
        ), (
            f"{ctx.where()} {name} ({what}): forward output differs from the oracle's (max abs "
            f"difference {(seen[name].detach().cpu() - expected.detach().cpu()).abs().max():.3g}): "
            "the unsharded parameters are not the original ones"
        )
    out.sum().backward()
    oracle_out.sum().backward()
    for fqn, param in model.named_parameters():
        fqn = ctx.impl.clean_fqn(fqn)
        (placement,) = param.placements
        assert isinstance(placement, Shard), f"{ctx.where()} {fqn}: placement {placement}"
        grad = param.grad
        assert isinstance(grad, DTensor) and tuple(grad.placements) == tuple(param.placements), (
            f"{ctx.where()} {fqn} ({what}): gradient placements "
            f"{getattr(grad, 'placements', type(grad).__name__)}, expected {param.placements}"
        )
        expected = chunk_of(oracle.get_parameter(fqn).grad, placement.dim, ctx.world_size, ctx.rank)
        assert grad.to_local().shape == expected.shape, (
            f"{ctx.where()} {fqn} ({what}): local grad {tuple(grad.to_local().shape)}, expected "
            f"{tuple(expected.shape)}"
        )
        assert torch.allclose(grad.to_local().cpu(), expected.cpu(), rtol=1e-5, atol=1e-6), (
            f"{ctx.where()} {fqn} ({what}): local grad differs from the oracle gradient's chunk"
        )


def assert_placed(ctx, model, originals, dims, what):
    from torch.distributed.tensor import DTensor, Shard

    for fqn, param in model.named_parameters():
        fqn = ctx.impl.clean_fqn(fqn)
        orig, dim = originals[fqn], dims[fqn]
        assert isinstance(param, DTensor), f"{ctx.where()} {fqn}: not a DTensor"
        assert tuple(param.placements) == (Shard(dim),), (
            f"{ctx.where()} {fqn} ({what}): placements {param.placements}, expected (Shard({dim}),)"
        )
        assert tuple(param.shape) == tuple(orig.shape) and param.stride() == orig.stride(), (
            f"{ctx.where()} {fqn}: global size/stride {tuple(param.shape)}/{param.stride()}, expected "
            f"{tuple(orig.shape)}/{orig.stride()}"
        )
        expected = chunk_of(orig, dim, ctx.world_size, ctx.rank)
        local = param.to_local().detach().cpu()
        assert local.shape == expected.shape and torch.equal(local, expected), (
            f"{ctx.where()} {fqn} ({what}): local {tuple(local.shape)} is not chunk {ctx.rank} of "
            f"{ctx.world_size} on dim {dim} {tuple(expected.shape)}"
        )
        assert local.is_contiguous(), f"{ctx.where()} {fqn}: local shard is not contiguous"


PLACEMENT_FNS = {
    # name: (fn building the placement from the parameter, expected dim per parameter ndim/shape)
    "shard1-2d": (lambda p: 1 if p.ndim == 2 else 0),
    "shard-neg1": (lambda p: -1),
    "largest-dim": (lambda p: max(range(p.ndim), key=lambda d: p.shape[d])),
}


@check(
    area="placement",
    requires={base.SHARD_PLACEMENT_FN, base.DTENSOR_PARAMS, base.TRAINING},
    cases={k: {"name": k} for k in PLACEMENT_FNS},
)
def shard_placement_fn_layout(ctx, name):
    """shard_placement_fn's Shard(d) (Shard(-1) normalised to Shard(ndim-1)) gives each rank
    ``torch.chunk(p, ws, d)[rank]`` as a contiguous local tensor of a DTensor with the original size
    and stride; gradients share the placement and equal the oracle gradient's chunk."""
    from torch.distributed.tensor import Shard

    pick = PLACEMENT_FNS[name]
    model = Two(ctx.world_size).to(ctx.device)
    oracle = copy.deepcopy(model)
    originals = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    dims = {n: pick(p) % p.ndim for n, p in model.named_parameters()}
    model = ctx.impl.shard(
        model,
        ctx,
        plan=[("a", {}), ("b", {}), ("", {})],
        shard_placement_fn=lambda p: Shard(pick(p)),
    )
    assert_placed(ctx, model, originals, dims, f"shard_placement_fn {name}")
    x = (distinct_values((2, 2 * ctx.world_size), 7) / 100.0).to(ctx.device)
    _grads_and_values(ctx, model, oracle, x, name)
    assert_placed(ctx, model, originals, dims, f"shard_placement_fn {name}, after backward")
    for fqn, param in model.named_parameters():
        assert torch.equal(param.full_tensor().detach().cpu(), originals[fqn]), (
            f"{ctx.where()} {fqn}: full_tensor() differs from the original"
        )


@check(area="placement", requires={base.DTENSOR_PARAMS, base.TRAINING}, min_world_size=2)
def empty_rank_shards(ctx):
    """Parameters with dim 0 below the world size: ranks past the last chunk hold (0, *rest) local
    tensors, forward/backward runs on every rank, and every gradient is the oracle's chunk."""
    ws = ctx.world_size
    net = _BagNet(ws).to(ctx.device)
    oracle = copy.deepcopy(net)
    originals = {n: p.detach().clone().cpu() for n, p in net.named_parameters()}
    net = ctx.impl.shard(net, ctx)
    assert_placed(ctx, net, originals, dict.fromkeys(originals, 0), "dim 0 < world size")
    for fqn, param in net.named_parameters():
        fqn = ctx.impl.clean_fqn(fqn)
        expect_rows = chunk_of(originals[fqn], 0, ws, ctx.rank).shape[0]
        if expect_rows == 0:
            assert param.to_local().shape == (0, *originals[fqn].shape[1:]), (
                f"{ctx.where()} {fqn}: empty local shard has shape {tuple(param.to_local().shape)}"
            )
    x = (distinct_values((2, 6), 3) / 100.0).to(ctx.device)
    _grads_and_values(ctx, net, oracle, x, "dim 0 < world size")


class _BagNet(nn.Module):
    """Uses parameters (1, 6), (ws-1, 3) and (6,): rows below the world size."""

    def __init__(self, ws):
        super().__init__()
        self.row = nn.Parameter(distinct_values((1, 6), 0) / 100.0)
        self.few = nn.Parameter(distinct_values((ws - 1, 3), 1) / 100.0)
        self.vec = nn.Parameter(distinct_values((6,), 2) / 100.0)

    def forward(self, x):
        h = x * self.row + self.vec  # (n, 6)
        return h[:, :3].unsqueeze(1) * self.few.unsqueeze(0)


ERRORS = {
    "replicate": (ValueError, r"Invalid shard_placement_fn result"),
    "shard1-on-1d": (AssertionError, r"Shard dim 1 is invalid for 1D tensor"),
    "uneven-dim1": (NotImplementedError, r"uneven sharding on dim 1"),
    "shard2-on-2d": (AssertionError, r"Shard dim 2 is invalid for 2D tensor"),
}


def _error_case(ctx, name):
    from torch.distributed.tensor import Replicate, Shard

    if name == "replicate":
        return Lin(4, 3), lambda p: Replicate()
    if name == "shard1-on-1d":  # the 1-D parameter is the module's only one
        bag = ParamBag([(2 * ctx.world_size,)])
        return bag, lambda p: Shard(1)
    if name == "shard2-on-2d":
        return ParamBag([(2 * ctx.world_size, 4)]), lambda p: Shard(2)
    return ParamBag([(4, ctx.world_size + 1)]), lambda p: Shard(1)  # uneven dim 1


@check(
    area="placement",
    requires={base.SHARD_PLACEMENT_FN, base.FSDP2_API},
    cases={k: {"name": k} for k in ERRORS if k != "uneven-dim1"},
)
@check(
    area="placement",
    requires={base.SHARD_PLACEMENT_FN, base.FSDP2_API},
    cases={"uneven-dim1": {"name": "uneven-dim1"}},
    min_world_size=2,
)
def invalid_placement_errors(ctx, name):
    """Invalid shard_placement_fn results raise at fully_shard on every rank with upstream's error
    type and meaning: Replicate() -> ValueError 'Invalid shard_placement_fn result'; Shard(d) with
    d >= ndim -> AssertionError 'Shard dim d is invalid for <n>D tensor'; an uneven non-zero dim ->
    NotImplementedError 'FSDP does not support uneven sharding on dim d'."""
    exc_type, pattern = ERRORS[name]
    module, fn = _error_case(ctx, name)
    try:
        ctx.impl.ns.fully_shard(module.to(ctx.device), mesh=ctx.mesh, shard_placement_fn=fn)
    except exc_type as exc:
        assert re.search(pattern, str(exc)), (
            f"{ctx.where()} {name}: message {str(exc)[:200]!r} does not say {pattern!r}"
        )
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} {name}: raised {type(exc).__name__}: {str(exc)[:200]}, "
            f"expected {exc_type.__name__} matching {pattern!r}"
        ) from exc
    else:
        raise AssertionError(f"{ctx.where()} {name}: accepted; expected {exc_type.__name__}")


@check(area="placement", requires={base.HSDP, base.DTENSOR_PARAMS, base.TRAINING}, world_sizes=(4,))
def hsdp_placement_and_grads(ctx):
    """On a (replicate=2, shard=2) mesh every parameter is (Replicate(), Shard(0)) with chunk
    ``rank % 2`` locally, and after one backward on per-rank inputs every gradient's local piece is
    the chunk of the gradient averaged over all 4 ranks' inputs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = ctx.make_mesh((2, 2), ("replicate", "shard"))
    model = Two(ctx.world_size).to(ctx.device)  # b's dims 3: uneven over the shard dim of 2
    oracle = copy.deepcopy(model)
    originals = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    model = ctx.impl.shard(model, ctx, plan=[("a", {}), ("b", {}), ("", {})], mesh=mesh)
    for fqn, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{ctx.where()} {fqn}: not a DTensor"
        assert tuple(param.placements) == (Replicate(), Shard(0)), (
            f"{ctx.where()} {fqn}: placements {param.placements}, expected (Replicate(), Shard(0))"
        )
        expected = chunk_of(originals[fqn], 0, 2, ctx.rank % 2)
        assert torch.equal(param.to_local().detach().cpu(), expected), (
            f"{ctx.where()} {fqn}: local {tuple(param.to_local().shape)} is not chunk {ctx.rank % 2} of 2"
        )
    xs = (distinct_values((4 * 2, 8), 5) / 100.0).to(ctx.device)
    mine = xs[2 * ctx.rank : 2 * ctx.rank + 2]
    model(mine).pow(2).mean().backward()
    for r in range(4):  # mean over ranks of each rank's mean loss
        (oracle(xs[2 * r : 2 * r + 2]).pow(2).mean() / 4).backward()
    for fqn, param in model.named_parameters():
        expected = chunk_of(oracle.get_parameter(fqn).grad, 0, 2, ctx.rank % 2)
        got = param.grad.to_local().detach().cpu()
        assert got.shape == expected.shape and torch.allclose(
            got, expected.cpu(), rtol=1e-5, atol=1e-6
        ), f"{ctx.where()} {fqn}: HSDP grad chunk differs from the all-rank mean gradient's chunk"


# -- load_state_dict(assign=True) into Shard(1) parameters (P116) --------------------------------
ASSIGNED = {
    # name: (placement of the loaded DTensor, expected error or None)
    "shard1-dtensor": ("shard1", None),
    "replicate-dtensor": ("replicate", (AssertionError, r"Shard\(1\) requires even sharding")),
    "shard0-dtensor": ("shard0", (AssertionError, r"Shard\(1\) requires even sharding")),
}


@check(
    area="placement",
    requires={base.SHARD_PLACEMENT_FN, base.DTENSOR_PARAMS, base.FSDP2_API, base.TRAINING},
    cases={k: {"name": k} for k in ASSIGNED},
    min_world_size=2,
)
def assign_load_into_shard1(ctx, name):
    """P116: a bias-free ``Lin(2ws, 4)`` sharded with ``shard_placement_fn=lambda p: Shard(1)``
    (local (4, 2)) takes ``load_state_dict({"weight": dt}, assign=True)`` of new values ``w``
    (``dt = distribute_tensor(w, mesh, placements)``): with ``(Shard(1),)`` the weight stays a
    ``(Shard(1),)`` DTensor whose local tensor is chunk ``rank`` of ``w`` on dim 1, and a forward/
    backward gives the output and gradient chunk of the unsharded module holding ``w``; a
    ``(Replicate(),)`` or ``(Shard(0),)`` DTensor (local shape other than the Shard(1) shard) is
    refused by the load with AssertionError 'Shard(1) requires even sharding: local_tensor.size()=...'
    (a non-zero shard dim is never re-padded), on every rank."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ws = ctx.world_size
    placement, error = ASSIGNED[name]
    model = Lin(2 * ws, 4, bias=False).to(ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, shard_placement_fn=lambda p: Shard(1))
    new = (distinct_values((4, 2 * ws), 5) / 100.0).to(ctx.device)
    placements = {"shard1": [Shard(1)], "shard0": [Shard(0)], "replicate": [Replicate()]}
    loaded = distribute_tensor(new.clone(), ctx.mesh, placements[placement])
    load = lambda: model.load_state_dict({"weight": loaded}, assign=True)  # noqa: E731
    if error is not None:
        expect_error(ctx, f"assign-load of a {placement} DTensor", *error, load)
        return
    load()
    oracle = Lin(2 * ws, 4, bias=False).to(ctx.device)
    with torch.no_grad():
        oracle.weight.copy_(new)
    assert_placed(ctx, model, {"weight": new.cpu()}, {"weight": 1}, "after the assign-load")
    x = (distinct_values((2, 2 * ws), 7) / 100.0).to(ctx.device)
    _grads_and_values(ctx, model, oracle, x, "after the assign-load")
