"""Area "bad_input": ``fully_shard`` rejects bad input at once, on every rank, with upstream's error
type and meaning, and leaves the module as it was (P3, P12, P13).

[Note: left as it was]
After a rejected call every submodule keeps its class (no FSDP subclass swapped in) and every
parameter is the same object with the same values; where the module itself was fine (a bad
argument), a correct ``fully_shard`` call on it afterwards succeeds and shards it as usual.
Messages are matched on upstream's key words (a regex), not byte for byte.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._models import distinct_values
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
            f"{type(module).__name__}, expected it left as {classes.get(name).__name__}")
    now = dict(model.named_parameters())
    assert set(now) == set(params), f"{ctx.where()} after the rejected {what}: parameters {sorted(now)}"
    for name, (obj, value) in params.items():
        assert now[name] is obj, (
            f"{ctx.where()} after the rejected {what}: parameter {name} was replaced "
            f"(now {type(now[name]).__name__}); expected the original object")
        if value.device.type != "meta":
            assert torch.equal(now[name].detach(), value), (
                f"{ctx.where()} after the rejected {what}: parameter {name} changed value")


def expect_rejected(ctx, model, call, exc_type, pattern, what):
    """``call()`` raises ``exc_type`` matching ``pattern`` and leaves ``model`` as it was."""
    snap = snapshot(model)
    try:
        call()
    except exc_type as exc:
        assert re.search(pattern, str(exc)), (
            f"{ctx.where()} {what}: {type(exc).__name__} message {str(exc)[:300]!r} does not say "
            f"{pattern!r}")
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} {what}: raised {type(exc).__name__}({str(exc)[:200]!r}), expected "
            f"{exc_type.__name__} matching {pattern!r}") from exc
    else:
        raise AssertionError(f"{ctx.where()} {what}: no error, expected {exc_type.__name__} "
                             f"matching {pattern!r}")
    assert_unchanged(ctx, model, snap, what)


def shard_again_works(ctx, model):
    """A correct fully_shard on the module afterwards shards it (Shard(0) DTensors, right rows)."""
    from torch.distributed.tensor import DTensor

    originals = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {name}: a valid fully_shard after the rejected one did not shard it")
        assert torch.equal(param.full_tensor().detach().cpu(), originals[name]), (
            f"{ctx.where()} {name}: values differ after the valid fully_shard")


API = {base.FSDP2_API}


@check(area="bad_input", requires=API)
def scalar_parameter(ctx):
    """A 0-dim parameter: ValueError 'fully_shard doesn't support scalar parameters. Change <name>
    to a 1D tensor with numel equal to 1.'; module unchanged."""
    model = Two(torch.tensor(2.5)).to(ctx.device)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh), ValueError,
                    r"scalar parameter.*extra.*1D tensor", "fully_shard with a scalar parameter")


@check(area="bad_input", requires=API,
       cases={"transposed": {"kind": "t"}, "channels-last": {"kind": "cl"},
              "transposed-only": {"kind": "only"}})
def noncontiguous_parameter(ctx, kind):
    """A non-contiguous parameter (a transposed view, a channels_last conv weight; after a good
    parameter, or as the only one): NotImplementedError 'FSDP does not support non-contiguous
    parameters yet'; module unchanged."""
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
    assert not dict(model.named_parameters())["extra" if kind == "t" else "conv.weight"].is_contiguous()
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh),
                    NotImplementedError, r"non-contiguous param",
                    "fully_shard with a non-contiguous parameter")


@check(area="bad_input", requires=API)
def mesh_3d(ctx):
    """A 3-D mesh: ValueError 'fully_shard expects a 1D or 2D DeviceMesh'; module unchanged and a
    valid call afterwards works."""
    mesh = ctx.make_mesh((ctx.world_size, 1, 1), ("a", "b", "c"))
    model = Two().to(ctx.device)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(model, mesh=mesh), ValueError,
                    r"1D or 2D (Device)?Mesh", "fully_shard on a 3-D mesh")


@check(area="bad_input", requires=API | {base.HSDP})
def mesh_2d_without_names(ctx):
    """A 2-D mesh without mesh_dim_names: AssertionError asking for mesh_dim_names (HSDP needs
    them); module unchanged and a valid call afterwards works."""
    mesh = ctx.make_mesh((1, ctx.world_size))
    model = Two().to(ctx.device)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(model, mesh=mesh), AssertionError,
                    r"mesh_dim_names", "fully_shard on an unnamed 2-D mesh")


RAF_BAD = {
    "int-zero": {"value": lambda ws: 0, "exc": ValueError, "pattern": r"factor of {ws}, not 0"},
    "int-above-ws": {"value": lambda ws: ws + 1, "exc": ValueError,
                     "pattern": r"factor of {ws}, not {v}"},
    "int-negative": {"value": lambda ws: -2, "exc": ValueError, "pattern": r"factor of {ws}, not -2"},
    "str": {"value": lambda ws: "yes", "exc": ValueError, "pattern": r"bool or an int.*not yes"},
    "float": {"value": lambda ws: 0.5, "exc": ValueError, "pattern": r"bool or an int.*not 0\.5"},
}


@check(area="bad_input", requires=API | {base.RESHARD_AFTER_FORWARD},
       cases={k: {"name": k} for k in RAF_BAD})
def invalid_reshard_after_forward(ctx, name):
    """An int reshard_after_forward that is not a factor of the shard-mesh size (0, ws+1, negative)
    -> ValueError '... should be a factor of <ws>, not <v>'; a non-bool/int -> ValueError
    'reshard_after_forward should be a bool or an int ...'; module unchanged, valid call works."""
    spec = RAF_BAD[name]
    value = spec["value"](ctx.world_size)
    pattern = spec["pattern"].format(ws=ctx.world_size, v=value)
    model = Two().to(ctx.device)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(
        model, mesh=ctx.mesh, reshard_after_forward=value), spec["exc"], pattern,
        f"fully_shard(reshard_after_forward={value!r})")


@check(area="bad_input", requires=API | {base.RESHARD_AFTER_FORWARD}, world_sizes=(4,))
def invalid_reshard_after_forward_non_factor(ctx):
    """reshard_after_forward=3 at world size 4 -> ValueError '... a factor of 4, not 3'."""
    model = Two().to(ctx.device)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(
        model, mesh=ctx.mesh, reshard_after_forward=3), ValueError, r"factor of 4, not 3",
        "fully_shard(reshard_after_forward=3)")


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


@check(area="bad_input", requires=API | {base.SHARD_PLACEMENT_FN},
       cases={k: {"name": k} for k in PLACEMENT_BAD if k != "uneven-dim1"})
@check(area="bad_input", requires=API | {base.SHARD_PLACEMENT_FN},
       cases={"uneven-dim1": {"name": "uneven-dim1"}}, min_world_size=2)
def invalid_shard_placement(ctx, name):
    """shard_placement_fn returning Replicate() -> ValueError 'Invalid shard_placement_fn result';
    Shard(1) for a 1-D parameter -> AssertionError 'Shard dim 1 is invalid for 1D tensor'; Shard(1)
    on a dim not divisible by the world size (ws > 1) -> NotImplementedError 'FSDP does not support
    uneven sharding on dim 1'; module unchanged."""
    spec = PLACEMENT_BAD[name]
    model, fn = placement_case(ctx, name)
    expect_rejected(ctx, model, lambda: ctx.impl.ns.fully_shard(
        model, mesh=ctx.mesh, shard_placement_fn=fn), spec["exc"], spec["pattern"],
        f"fully_shard with shard_placement_fn ({name})")


@check(area="bad_input", requires=API)
def forward_on_meta_params(ctx):
    """Forward through a module sharded on the meta device without materializing it: RuntimeError
    'FSDP parameters should be materialized from meta device before training, but the following
    were still on meta device: [<fqns>]'; the parameters stay as they were."""
    with torch.device("meta"):
        model = Two()
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    x = torch.ones(2, 3, device=ctx.device)
    expect_rejected(ctx, model, lambda: model(x), RuntimeError,
                    r"materialized from meta device.*lin\.weight", "forward on meta parameters")


RETRY_CASES = {
    "after-3d-mesh": {"bad": lambda ctx: {"mesh": ctx.make_mesh((ctx.world_size, 1, 1), ("a", "b", "c"))}},
    "after-bad-reshard": {"bad": lambda ctx: {"mesh": ctx.mesh, "reshard_after_forward": "yes"}},
}


@check(area="bad_input", requires=API, cases={k: {"name": k} for k in RETRY_CASES})
def valid_call_after_rejection(ctx, name):
    """After ``fully_shard`` rejected a bad argument, the (untouched) module can still be sharded by a
    correct call, which shards it as usual."""
    model = Two().to(ctx.device)
    try:
        ctx.impl.ns.fully_shard(model, **RETRY_CASES[name]["bad"](ctx))
    except (ValueError, AssertionError, NotImplementedError):
        pass
    else:
        raise AssertionError(f"{ctx.where()} the bad call ({name}) was accepted")
    shard_again_works(ctx, model)
