"""Area "fsdp1_runtime": FSDP1's refusals on paths no other case ran: constructor arguments,
``register_comm_hook``, units of mixed ``use_orig_params``, a double backward and
``ShardedGradScaler.update`` (R95-R98, R101). The state-dict and optimizer-state ones (R99, R100,
R102, R103) are in ``conformance/checks/state_dict/optim_refusals.py``.

[Note: refusals are contracts]
Each refusal is pinned by its exception type and a stable part of its message (upstream's
wording), and where it is cheap the check also shows that the refused call changed nothing: the
module keeps its parameters, a later valid call still succeeds, the settings stay as they were.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import B
from conformance.checks.fsdp1.knobs import recording_comm_hook
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _kwargs(ctx):
    return {"device_id": torch.device("cpu")} if ctx.device.type == "cpu" else {}


def _batch(ctx, salt: int) -> torch.Tensor:
    """``B`` samples of 4 features, the same on every rank."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(B, 4, generator=g).to(ctx.device)


def _nested(ctx, fsdp, child_kwargs=None, root_kwargs=None):
    """``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))``."""
    ctx.seed(0)
    child = fsdp(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx), **(child_kwargs or {}))
    seq = nn.Sequential(child, nn.Linear(4, 4).to(ctx.device))
    return fsdp(seq, **_kwargs(ctx), **(root_kwargs or {}))


# ------------------------------------------------------------------------------ R95
def _int_param(ctx):
    m = nn.Module()
    m.p = nn.Parameter(torch.ones(4, dtype=torch.int64, device=ctx.device), requires_grad=False)
    return m, {}


def _mixed_requires_grad(ctx):
    m = nn.Linear(4, 4).to(ctx.device)
    m.weight.requires_grad_(False)
    return m, {"use_orig_params": False}


def _both_ignored(ctx):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    return m, {"ignored_modules": [m[0]], "ignored_states": [m[1]]}


def _init_fn_not_callable(ctx):
    return nn.Linear(4, 4, device="meta"), {"param_init_fn": 5}


def _group_and_mesh(ctx):
    mesh = ctx.make_mesh((ctx.world_size,), ("shard",))
    return nn.Linear(4, 4).to(ctx.device), {"process_group": mesh.get_group(), "device_mesh": mesh}


CONSTRUCTOR_CASES = {
    "integer_param": {
        "build": _int_param,
        "exc": ValueError,
        "pattern": r"Cannot flatten integer dtype tensors",
    },
    "mixed_requires_grad": {
        "build": _mixed_requires_grad,
        "exc": ValueError,
        "pattern": r"uniform `requires_grad` when `use_orig_params=False`",
    },
    "ignored_modules_and_states": {
        "build": _both_ignored,
        "exc": ValueError,
        "pattern": r"Cannot pass both ignored_modules and ignored_states",
    },
    "param_init_fn_not_callable": {
        "build": _init_fn_not_callable,
        "exc": ValueError,
        "pattern": r"to be callable but got <class 'int'>",
    },
    "process_group_and_mesh": {
        "build": _group_and_mesh,
        "exc": ValueError,
        "pattern": r"Cannot pass both process_group and device_mesh",
    },
}


@check(area="fsdp1_runtime", requires=REQUIRES, cases=CONSTRUCTOR_CASES, world_sizes=(1,))
def constructor_argument_refusals(ctx, build, exc, pattern):
    """R95: ``FullyShardedDataParallel(module, ...)`` refuses, with ValueError and upstream's
    words, a module holding an integer parameter ("Cannot flatten integer dtype tensors"), a
    Linear whose weight alone is frozen under ``use_orig_params=False`` ("uniform
    `requires_grad` when `use_orig_params=False`"), both ``ignored_modules`` and
    ``ignored_states`` ("Cannot pass both ignored_modules and ignored_states"), a
    ``param_init_fn`` that is not callable ("... to be callable but got <class 'int'>") and both
    ``process_group`` and ``device_mesh`` ("Cannot pass both process_group and device_mesh").
    The refused module keeps its parameters: the same names, objects and values, and no child
    ``_fsdp_wrapped_module``."""
    module, kwargs = build(ctx)
    before = {n: (p, p.detach().clone()) for n, p in module.named_parameters()}
    expect_error(
        ctx,
        f"FSDP(module, {sorted(kwargs)})",
        exc,
        pattern,
        lambda: ctx.impl.ns.FullyShardedDataParallel(module, **kwargs, **_kwargs(ctx)),
    )
    after = dict(module.named_parameters())
    assert list(after) == list(before), (
        f"{ctx.where()} after the refused construction the parameter names are {list(after)}, "
        f"were {list(before)}"
    )
    assert "_fsdp_wrapped_module" not in dict(module.named_children()), (
        f"{ctx.where()} the refused construction left a wrapped child in the module"
    )
    for name, (param, value) in before.items():
        assert after[name] is param, f"{ctx.where()} {name} was replaced by the refused call"
        if not value.is_meta:
            assert torch.equal(after[name].detach(), value), (
                f"{ctx.where()} {name} changed value in the refused construction"
            )


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_HYBRID_SHARD}, world_sizes=(1,))
def hybrid_shard_without_group_refused(ctx):
    """R95: ``sharding_strategy=HYBRID_SHARD`` with neither ``process_group`` nor
    ``device_mesh`` nor an ``auto_wrap_policy`` is refused with ValueError "... requires explicit
    specification of process group or device_mesh"."""
    ns = ctx.impl.ns
    expect_error(
        ctx,
        "HYBRID_SHARD without a process group or mesh",
        ValueError,
        r"requires explicit specification of process group or device_mesh",
        lambda: ns.FullyShardedDataParallel(
            nn.Linear(4, 4).to(ctx.device),
            sharding_strategy=ns.ShardingStrategy.HYBRID_SHARD,
            **_kwargs(ctx),
        ),
    )


# ------------------------------------------------------------------------------ R96
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def comm_hook_refusals(ctx):
    """R96: over ``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))`` after a forward,
    ``register_comm_hook`` on the inner unit raises AssertionError "register_comm_hook can only
    be called on a root instance." and on the root with the hook ``5`` ValueError "... must be
    callable but got 5". Neither registers anything: the root then accepts a callable hook,
    which the next backward calls once per unit."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = _nested(ctx, fsdp)
    model(_batch(ctx, 96))
    calls = []

    hook = recording_comm_hook(calls)

    expect_error(
        ctx,
        "register_comm_hook on the inner unit",
        AssertionError,
        r"register_comm_hook can only be called on a root instance",
        lambda: model.module[0].register_comm_hook(None, hook),
    )
    expect_error(
        ctx,
        "register_comm_hook(None, 5) on the root",
        ValueError,
        r"must be callable but got 5",
        lambda: model.register_comm_hook(None, 5),
    )
    model.register_comm_hook("token", hook)
    model(_batch(ctx, 97)).sum().backward()
    assert calls == ["token", "token"], (
        f"{ctx.where()} the hook registered after the refusals got states {calls}, expected it "
        "once per unit (2) with 'token'"
    )


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_HYBRID_SHARD}, world_sizes=(4,))
def comm_hook_hybrid_refused(ctx):
    """R96: ``register_comm_hook`` on a root built with ``HYBRID_SHARD`` over a (2, 2)
    (replicate, shard) mesh raises AssertionError "Communication hook is not supported for
    hybrid strategies"."""
    ns = ctx.impl.ns
    model = ns.FullyShardedDataParallel(
        nn.Linear(4, 4).to(ctx.device),
        sharding_strategy=ns.ShardingStrategy.HYBRID_SHARD,
        device_mesh=ctx.make_mesh((2, 2), ("replicate", "shard")),
        **_kwargs(ctx),
    )
    expect_error(
        ctx,
        "register_comm_hook on a HYBRID_SHARD root",
        AssertionError,
        r"Communication hook is not supported for hybrid strategies",
        lambda: model.register_comm_hook(None, lambda *args: None),
    )


# ------------------------------------------------------------------------------ R97
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def mixed_use_orig_params_refused(ctx):
    """R97: a root with ``use_orig_params=False`` over ``Sequential(FSDP(Linear(4, 4),
    use_orig_params=True), Linear(4, 4))``: the first forward raises ValueError "Expects one
    homogeneous value for _use_orig_params" naming both values."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = _nested(ctx, fsdp, {"use_orig_params": True}, {"use_orig_params": False})
    expect_error(
        ctx,
        "first forward of units with use_orig_params True and False",
        ValueError,
        r"Expects one homogeneous value for _use_orig_params but got \{(False, True|True, False)\}",
        lambda: model(_batch(ctx, 97)),
    )


# ------------------------------------------------------------------------------ R98
@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"flat": {"orig": False}, "orig-params": {"orig": True}},
    world_sizes=(1, 2),
)
def double_backward_refused(ctx, orig):
    """R98: one unit over ``Linear(4, 4)`` (``use_orig_params`` False and True): a backward of
    ``out.pow(2).sum()`` with ``create_graph=True`` (its gradient itself needs a gradient)
    raises RuntimeError "FSDP does not support gradients of gradients" on every rank."""
    ctx.seed(0)
    model = ctx.impl.ns.FullyShardedDataParallel(
        nn.Linear(4, 4).to(ctx.device), use_orig_params=orig, **_kwargs(ctx)
    )
    expect_error(
        ctx,
        "backward(create_graph=True)",
        RuntimeError,
        r"FSDP does not support gradients of gradients",
        lambda: model(_batch(ctx, 98)).pow(2).sum().backward(create_graph=True),
    )


# ------------------------------------------------------------------------------ R101
@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_GRAD_SCALER},
    world_sizes=(1,),
)
def grad_scaler_new_scale_device_refused(ctx):
    """R101: ``ShardedGradScaler(device=<the compute device's type>, init_scale=4.0)`` after
    ``scale(loss).backward()`` and ``step``: ``update(new_scale=<a 1-element tensor on the meta
    device>)`` raises AssertionError "new_scale should be a float or a 1-element ..."; the scale
    stays 4.0."""
    mod = importlib.import_module(f"{ctx.impl.ns.__name__}.sharded_grad_scaler")
    scaler = mod.ShardedGradScaler(device=ctx.device.type, init_scale=4.0)
    ctx.seed(0)
    model = ctx.impl.ns.FullyShardedDataParallel(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(_batch(ctx, 101)).sum()).backward()
    scaler.step(opt)
    expect_error(
        ctx,
        "update(new_scale=<meta tensor>)",
        AssertionError,
        r"new_scale should be a float or a 1-element",
        lambda: scaler.update(new_scale=torch.tensor([2.0], device="meta")),
    )
    assert scaler.get_scale() == 4.0, (
        f"{ctx.where()} after the refused update the scale is {scaler.get_scale()}, expected 4.0"
    )
