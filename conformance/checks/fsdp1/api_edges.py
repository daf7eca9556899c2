"""Area "fsdp1_runtime": edges of FSDP1's static helpers and of ``no_sync`` (R35, R36, S37, S38).

[Note: which units are roots]
A unit is a root when no other FSDP module of the tree contains it. With the plan "inner, then
the whole model" the model object itself is the only root and ``model.inner`` (a unit too) is
not; both facts follow from the tree (``modules()`` order, containment), not from what the
implementation reports. A forward runs first, so every unit knows whether it is the root.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.fsdp1.summon_full_params import build, expect_refusal
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_RUNTIME}


def _units(model, FSDP) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _roots(units: list[nn.Module]) -> list[nn.Module]:
    """The units no other unit contains (see [Note: which units are roots])."""
    inside = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inside]


def _forward(ctx, model) -> None:
    ctx.seed(1)
    model(torch.randn(2, 5, device=ctx.device)).sum().backward()


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def fsdp_modules_root_only(ctx):
    """R35: ``FSDP.fsdp_modules(model)`` lists every FSDP module of the tree in ``modules()``
    order; with ``root_only=True`` only the roots (the units no other unit contains)."""
    model, _, FSDP = build(ctx, False)
    _forward(ctx, model)
    units = _units(model, FSDP)
    roots = _roots(units)
    assert len(units) == 2 and roots == [model], f"{ctx.where()} test setup: units {units}"
    got = FSDP.fsdp_modules(model)
    assert [id(m) for m in got] == [id(m) for m in units], (
        f"{ctx.where()} fsdp_modules(model): {[type(m).__name__ for m in got]} ({len(got)}), "
        f"expected every unit of the tree in modules() order ({len(units)})"
    )
    only = FSDP.fsdp_modules(model, root_only=True)
    assert [id(m) for m in only] == [id(m) for m in roots], (
        f"{ctx.where()} fsdp_modules(model, root_only=True): {len(only)} modules "
        f"(root included: {any(m is model for m in only)}), expected only the root"
    )


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def no_sync_inner_refused(ctx):
    """R36: ``no_sync()`` on a unit that is not the root raises RuntimeError naming
    ``no_sync()``; on the root it is accepted."""
    model, _, FSDP = build(ctx, False)
    _forward(ctx, model)
    (inner,) = [u for u in _units(model, FSDP) if u is not model]
    expect_refusal(ctx, "inner.no_sync()", RuntimeError, r"no_sync\(\)", inner.no_sync)
    with model.no_sync():
        pass


@check(area="state_dict", requires=REQUIRES, world_sizes=(1, 2))
def state_dict_type_single_module(ctx):
    """S37: on a model with exactly one FSDP module, ``FSDP.get_state_dict_type(model)`` returns
    that module's settings: after ``set_state_dict_type(model, SHARDED_STATE_DICT, cfg)`` the
    type, that very config object and a ShardedOptimStateDictConfig."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    ctx.seed(0)
    model = ctx.impl.shard(nn.Linear(5, 3).to(ctx.device), ctx, plan=[("", {})])
    assert len(_units(model, FSDP)) == 1, f"{ctx.where()} test setup: not one FSDP module"
    cfg = ns.ShardedStateDictConfig()
    FSDP.set_state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT, cfg)
    got = FSDP.get_state_dict_type(model)
    assert got.state_dict_type == ns.StateDictType.SHARDED_STATE_DICT, (
        f"{ctx.where()} get_state_dict_type: type {got.state_dict_type}, expected SHARDED"
    )
    assert got.state_dict_config is cfg, (
        f"{ctx.where()} get_state_dict_type: config {got.state_dict_config!r}, expected the "
        f"ShardedStateDictConfig passed to set_state_dict_type"
    )
    assert type(got.optim_state_dict_config) is ns.api.ShardedOptimStateDictConfig, (
        f"{ctx.where()} get_state_dict_type: optim config {got.optim_state_dict_config!r}, "
        f"expected the SHARDED type's default ShardedOptimStateDictConfig"
    )


@check(area="state_dict", requires=REQUIRES, world_sizes=(1, 2))
def set_state_dict_type_optim_mismatch(ctx):
    """S38: ``set_state_dict_type(model, SHARDED_STATE_DICT, optim_state_dict_config=
    FullOptimStateDictConfig())`` (an optim config of another type's class) raises RuntimeError
    naming the expected ShardedOptimStateDictConfig and the given FullOptimStateDictConfig."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    model, _, _ = build(ctx, False)

    def call():
        FSDP.set_state_dict_type(
            model,
            ns.StateDictType.SHARDED_STATE_DICT,
            optim_state_dict_config=ns.api.FullOptimStateDictConfig(),
        )

    try:
        call()
    except RuntimeError as exc:
        msg = str(exc)
        for name in ("ShardedOptimStateDictConfig", "FullOptimStateDictConfig"):
            assert re.search(name, msg), f"{ctx.where()} refusal {msg!r} does not name {name}"
        return
    raise AssertionError(
        f"{ctx.where()} set_state_dict_type(SHARDED, optim FullOptimStateDictConfig) accepted; "
        f"expected RuntimeError"
    )
