"""Area "bad_input": ``fully_shard`` rejects bad input at once, on every rank, with upstream's error
type and meaning (P3, P12, P13).

Messages are matched on upstream's key words (a regex), not byte for byte. This area checks the
contract only; what the module looks like after the rejection (this project's stricter rule, X1,
X2) is the ``strict`` area's, which runs these same checks with ``strict=True``.

``_snapshot`` and ``_assert_untouched`` are the refusal helpers of the other areas' checks
(``lifecycle.py``, ``mesh_dims.py``, ``per_param_mesh.py``): a refused ``fully_shard`` leaves no
``FSDPModule`` and the parameters as they were.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
from conformance.registry import check


class Two(nn.Module):
    """A good Linear first, then the parameter under test (so a half-applied call would show)."""

    def __init__(self, extra: torch.Tensor | None = None):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        with torch.no_grad():  # identical on every rank, no seed needed
            self.lin.weight.copy_(distinct_values((4, 3), 0) / 100.0)
            self.lin.bias.copy_(distinct_values((4,), 1) / 100.0)
        if extra is not None:
            self.extra = nn.Parameter(extra)

    def forward(self, x):
        return self.lin(x)


def snapshot(model):
    classes = {name: type(m) for name, m in model.named_modules()}
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    return classes, params


def assert_unchanged(ctx, model, snap, what):
    classes, params = snap
    for name, module in model.named_modules():
        assert type(module) is classes.get(name), (
            f"{ctx.where()} after the rejected {what}: module {name or '<root>'} is now "
            f"{type(module).__name__}, expected it left as {classes.get(name).__name__}"
        )
    now = dict(model.named_parameters())
    assert set(now) == set(params), (
        f"{ctx.where()} after the rejected {what}: parameters {sorted(now)}"
    )
    for name, (obj, value) in params.items():
        assert now[name] is obj, (
            f"{ctx.where()} after the rejected {what}: parameter {name} was replaced "
            f"(now {type(now[name]).__name__}); expected the original object"
        )
        if value.device.type != "meta":
            assert torch.equal(now[name].detach(), value), (
                f"{ctx.where()} after the rejected {what}: parameter {name} changed value"
            )


def expect_rejected(ctx, model, call, exc_type, pattern, what, strict=False):
    """``call()`` raises ``exc_type`` matching ``pattern``; with ``strict``, ``model`` is left as
    it was (X1)."""
    snap = snapshot(model) if strict else None
    try:
        call()
    except exc_type as exc:
        assert re.search(pattern, str(exc)), (
            f"{ctx.where()} {what}: {type(exc).__name__} message {str(exc)[:300]!r} does not say "
            f"{pattern!r}"
        )
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} {what}: raised {type(exc).__name__}({str(exc)[:200]!r}), expected "
            f"{exc_type.__name__} matching {pattern!r}"
        ) from exc
    else:
        raise AssertionError(
            f"{ctx.where()} {what}: no error, expected {exc_type.__name__} matching {pattern!r}"
        )
    if strict:
        assert_unchanged(ctx, model, snap, what)


API = {base.FSDP2_API}


@check(area="bad_input", requires=API)
def scalar_parameter(ctx, strict=False):
    """A 0-dim parameter is rejected with ValueError 'fully_shard doesn't support scalar parameters.
    Change <name> to a 1D tensor with numel equal to 1.' (P12)."""
    model = Two(torch.tensor(2.5)).to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh),
        ValueError,
        r"scalar parameter.*extra.*1D tensor",
        "fully_shard with a scalar parameter",
        strict,
    )


NONCONTIGUOUS_CASES = {
    "transposed": {"kind": "t"},
    "channels-last": {"kind": "cl"},
    "transposed-only": {"kind": "only"},
}


@check(area="bad_input", requires=API, cases=NONCONTIGUOUS_CASES)
def noncontiguous_parameter(ctx, kind, strict=False):
    """A non-contiguous parameter is rejected with NotImplementedError 'FSDP does not support
    non-contiguous parameters yet' (P12): a transposed view or a channels_last conv weight, after a
    good parameter or as the only one."""
    if kind == "only":
        model = nn.Module()
        model.extra = nn.Parameter(distinct_values((6, 4), 1).t().to(ctx.device))
        kind = "t"
    elif kind == "t":
        model = Two(distinct_values((6, 4), 1).t()).to(ctx.device)
    else:
        model = Two().to(ctx.device)
        ctx.seed(0)
        model.conv = nn.Conv2d(8, 8, 3).to(ctx.device).to(memory_format=torch.channels_last)
    assert not dict(model.named_parameters())[
        "extra" if kind == "t" else "conv.weight"
    ].is_contiguous()
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh),
        NotImplementedError,
        r"non-contiguous param",
        "fully_shard with a non-contiguous parameter",
        strict,
    )


@check(area="bad_input", requires=API)
def mesh_3d(ctx, strict=False):
    """A 3-D mesh is rejected with ValueError 'fully_shard expects a 1D or 2D DeviceMesh' (P12)."""
    mesh = ctx.make_mesh((ctx.world_size, 1, 1), ("a", "b", "c"))
    model = Two().to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=mesh),
        ValueError,
        r"1D or 2D (Device)?Mesh",
        "fully_shard on a 3-D mesh",
        strict,
    )


@check(area="bad_input", requires=API | {base.HSDP})
def mesh_2d_without_names(ctx, strict=False):
    """A 2-D mesh without mesh_dim_names is rejected with an AssertionError asking for
    mesh_dim_names, which HSDP needs (P12, P16)."""
    mesh = ctx.make_mesh((1, ctx.world_size))
    model = Two().to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=mesh),
        AssertionError,
        r"mesh_dim_names",
        "fully_shard on an unnamed 2-D mesh",
        strict,
    )


RAF_BAD = {
    "int-zero": {"value": lambda ws: 0, "exc": ValueError, "pattern": r"factor of {ws}, not 0"},
    "int-above-ws": {
        "value": lambda ws: ws + 1,
        "exc": ValueError,
        "pattern": r"factor of {ws}, not {v}",
    },
    "int-negative": {
        "value": lambda ws: -2,
        "exc": ValueError,
        "pattern": r"factor of {ws}, not -2",
    },
    "str": {"value": lambda ws: "yes", "exc": ValueError, "pattern": r"bool or an int.*not yes"},
    "float": {"value": lambda ws: 0.5, "exc": ValueError, "pattern": r"bool or an int.*not 0\.5"},
}


RAF_CASES = {k: {"name": k} for k in RAF_BAD}


@check(area="bad_input", requires=API | {base.RESHARD_AFTER_FORWARD}, cases=RAF_CASES)
def invalid_reshard_after_forward(ctx, name, strict=False):
    """A bad reshard_after_forward is rejected with ValueError (P3): an int that is not a factor of
    the shard-mesh size (0, ws+1, negative) '... should be a factor of <ws>, not <v>', anything but
    a bool or an int 'reshard_after_forward should be a bool or an int ...'."""
    spec = RAF_BAD[name]
    value = spec["value"](ctx.world_size)
    pattern = spec["pattern"].format(ws=ctx.world_size, v=value)
    model = Two().to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, reshard_after_forward=value),
        spec["exc"],
        pattern,
        f"fully_shard(reshard_after_forward={value!r})",
        strict,
    )


@check(area="bad_input", requires=API | {base.RESHARD_AFTER_FORWARD}, world_sizes=(4,))
def invalid_reshard_after_forward_non_factor(ctx, strict=False):
    """reshard_after_forward=3 at world size 4 is rejected with ValueError '... a factor of 4, not
    3' (P3)."""
    model = Two().to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, reshard_after_forward=3),
        ValueError,
        r"factor of 4, not 3",
        "fully_shard(reshard_after_forward=3)",
        strict,
    )


PLACEMENT_BAD = {
    "replicate": {"exc": ValueError, "pattern": r"Invalid shard_placement_fn result"},
    "shard1-on-1d": {"exc": AssertionError, "pattern": r"Shard dim 1 is invalid for 1D tensor"},
    "uneven-dim1": {"exc": NotImplementedError, "pattern": r"uneven sharding on dim 1"},
}


def placement_case(ctx, name):
    """(model, shard_placement_fn) for an invalid-placement case."""
    from torch.distributed.tensor import Replicate, Shard

    if name == "replicate":
        return Two().to(ctx.device), lambda p: Replicate()
    if name == "shard1-on-1d":  # Shard(0) for the weight, Shard(1) for the 1-D bias
        return Two().to(ctx.device), lambda p: Shard(1) if p.ndim == 1 else Shard(0)
    # dim 1 of the extra parameter is ws + 1 (not divisible); the Linear's dim 1 (3) is left on dim 0
    model = Two(distinct_values((5, ctx.world_size + 1), 1)).to(ctx.device)  # (5, ws+1): not lin's
    return model, lambda p: Shard(1) if p.shape == (5, ctx.world_size + 1) else Shard(0)


PLACEMENT_CASES = {k: {"name": k} for k in PLACEMENT_BAD if k != "uneven-dim1"}
UNEVEN_PLACEMENT_CASES = {"uneven-dim1": {"name": "uneven-dim1"}}  # needs ws > 1


@check(area="bad_input", requires=API | {base.SHARD_PLACEMENT_FN}, cases=PLACEMENT_CASES)
@check(
    area="bad_input",
    requires=API | {base.SHARD_PLACEMENT_FN},
    cases=UNEVEN_PLACEMENT_CASES,
    min_world_size=2,
)
def invalid_shard_placement(ctx, name, strict=False):
    """An invalid shard_placement_fn result is rejected (P13): Replicate() with ValueError 'Invalid
    shard_placement_fn result', Shard(1) for a 1-D parameter with AssertionError 'Shard dim 1 is
    invalid for 1D tensor', Shard(1) on a dim not divisible by the world size (ws > 1) with
    NotImplementedError 'FSDP does not support uneven sharding on dim 1'."""
    spec = PLACEMENT_BAD[name]
    model, fn = placement_case(ctx, name)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, shard_placement_fn=fn),
        spec["exc"],
        spec["pattern"],
        f"fully_shard with shard_placement_fn ({name})",
        strict,
    )


@check(area="bad_input", requires=API)
def forward_on_meta_params(ctx, strict=False):
    """A forward through a module sharded on the meta device, not materialized, raises RuntimeError
    'FSDP parameters should be materialized from meta device before training, but the following
    were still on meta device: [<fqns>]' (P10)."""
    with torch.device("meta"):
        model = Two()
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    x = torch.ones(2, 3, device=ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: model(x),
        RuntimeError,
        r"materialized from meta device.*lin\.weight",
        "forward on meta parameters",
        strict,
    )


@check(area="bad_input", requires=API)
def options_are_keyword_only(ctx, strict=False):
    """Every option after the module is keyword-only: ``fully_shard(model, mesh)`` with the mesh
    passed by position raises TypeError '... takes 1 positional argument but 2 were given' instead
    of sharding on it (P66); the same mesh by keyword shards a module."""
    model = Two().to(ctx.device)
    expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, ctx.mesh),
        TypeError,
        r"positional argument",
        "fully_shard(model, mesh) with the mesh passed by position",
        strict,
    )
    fresh = ctx.impl.ns.fully_shard(Two().to(ctx.device), mesh=ctx.mesh)
    assert isinstance(fresh, ctx.impl.ns.FSDPModule), (
        f"{ctx.where()} fully_shard(model, mesh=mesh): {type(fresh).__name__} is no FSDPModule"
    )


def _snapshot(module):
    """name -> (type, placements or None, full values) of ``module``'s parameters."""
    return {
        n: (
            type(p),
            getattr(p, "placements", None),
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(),
        )
        for n, p in module.named_parameters()
    }


def _assert_untouched(ctx, ns, module, before, what):
    """A refused ``fully_shard`` leaves no ``FSDPModule`` and the parameters as they were."""
    assert not isinstance(module, ns.FSDPModule), f"{ctx.where()} {what}: became an FSDPModule"
    for name, (kind, placements, values) in _snapshot(module).items():
        was = before[name]
        assert (kind, placements) == was[:2], (
            f"{ctx.where()} {what}: {name} is a {kind.__name__} {placements}, was a "
            f"{was[0].__name__} {was[1]}"
        )
        assert torch.equal(values, was[2]), f"{ctx.where()} {what}: {name} changed its values"
