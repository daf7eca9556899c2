"""Area "fsdp1_runtime": edges of FSDP1's static helpers and of ``no_sync`` (R35, R36, S37, S38).

[Note: which units are roots]
A unit is a root when no other FSDP module of the tree contains it. With the plan "inner, then
the whole model" the model object itself is the only root and ``model.inner`` (a unit too) is
not; both facts follow from the tree (``modules()`` order, containment), not from what the
implementation reports. A forward runs first, so every unit knows whether it is the root.
"""

from __future__ import annotations

import copy
import math
import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
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


class _Cyclic(nn.Module):
    """A container that belongs to a cycle of modules. Its ``children()`` counts the calls and
    raises past ``LIMIT`` so that a traversal which keeps coming back to it fails at once
    instead of looping forever (a walk that visits every module once asks a handful of times)."""

    LIMIT = 50

    def __init__(self):
        super().__init__()
        self.asked = 0

    def children(self):
        self.asked += 1
        if self.asked > self.LIMIT:
            raise RuntimeError(
                f"children() of one module asked {self.asked} times: a traversal loops"
            )
        return super().children()


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def fsdp_modules_cyclic_graph(ctx):
    """R35: a module graph with a cycle (``a`` holds the sharded model and ``b``, ``b`` holds
    ``a``): ``FSDP.fsdp_modules(a)`` returns, listing each unit once in ``a.modules()`` order (which
    visits every module once), and with ``root_only=True`` only the model's root unit."""
    model, _, FSDP = build(ctx, False)
    _forward(ctx, model)
    a, b = _Cyclic(), _Cyclic()
    a.add_module("model", model)
    a.add_module("b", b)
    b.add_module("a", a)
    try:
        units = _units(a, FSDP)
        assert len(units) == 2 and units[0] is model, f"{ctx.where()} test setup: units {units}"
        for root_only, want in ((False, units), (True, [model])):
            got = FSDP.fsdp_modules(a, root_only=root_only)
            assert [id(m) for m in got] == [id(m) for m in want], (
                f"{ctx.where()} fsdp_modules(a, root_only={root_only}) on a cyclic graph: "
                f"{[type(m).__name__ for m in got]}, expected {len(want)} unit(s), each once"
            )
    finally:
        del b._modules["a"]  # break the cycle


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
    type, that very config object and a ShardedOptimStateDictConfig. On a module holding no FSDP
    module it returns None; on a tree whose units' settings differ (only the inner unit set to
    SHARDED) it raises AssertionError "All FSDP modules must have the same state dict
    settings"."""
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
    plain = FSDP.get_state_dict_type(nn.Linear(2, 2))
    assert plain is None, (
        f"{ctx.where()} get_state_dict_type(a module without FSDP modules) = {plain!r}, "
        "expected None"
    )
    # two units whose settings differ: refused
    nested, _, _ = build(ctx, False)
    (inner,) = [u for u in _units(nested, FSDP) if u is not nested]
    FSDP.set_state_dict_type(inner, ns.StateDictType.SHARDED_STATE_DICT)
    expect_error(
        ctx,
        "get_state_dict_type(units with different settings)",
        AssertionError,
        "same state dict settings",
        lambda: FSDP.get_state_dict_type(nested),
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


# ------------------------------------------------------------------------------ flat sizes
SIZE_CASES = {
    "full-shard-orig": {"strategy": "FULL_SHARD", "orig": True},
    "no-shard-orig": {"strategy": "NO_SHARD", "orig": True},
    "no-shard-flat": {"strategy": "NO_SHARD", "orig": False},
}


@check(area="layout", requires=REQUIRES | {base.AUTO_WRAP}, cases=SIZE_CASES, world_sizes=(1, 2))
def flat_layout_sizes(ctx, strategy, orig):
    """R37: one unit over four parameters (numels 35, 7, 21, 3, none a multiple of the fp32
    alignment 4): ``_numels_with_padding`` follows R10's rule (a padding segment before each
    parameter that does not start aligned, with ``use_orig_params=True``); the total T is
    ``_unpadded_unsharded_size``; a sharded strategy has ``_sharded_size == (ceil(T/ws),)`` and
    ``_padded_unsharded_size == (ws * ceil(T/ws),)`` (after the lazy init of a forward), NO_SHARD
    ``_sharded_size == (T,)`` and, where it records one (upstream keeps none under NO_SHARD),
    ``_padded_unsharded_size == (T,)``. The padding segment at the end rounds T up to a multiple
    of the world size, also under NO_SHARD (the unit's process group is the world)."""
    from conformance.checks.fsdp1.wrapper_api import layout_rule

    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(ctx.device)
    kwargs = {"sharding_strategy": getattr(ns.ShardingStrategy, strategy)}
    model = ctx.impl.shard(oracle, ctx, plan=[("", kwargs)], use_orig_params=orig)
    read = getattr(ctx.impl, "_flat_params", None)
    if read is None:
        raise base.NotSupported("the flat parameters' layout metadata (adapter._flat_params)")
    model(torch.randn(2, 5, device=ctx.device)).sum().backward()
    ((_, flat),) = read(model)
    sharded = strategy != "NO_SHARD" and ctx.world_size > 1
    fields = ["_numels_with_padding", "_unpadded_unsharded_size", "_sharded_size"]
    if sharded or hasattr(flat, "_padded_unsharded_size"):
        fields.append("_padded_unsharded_size")
    if not hasattr(flat, "_numels_with_padding"):
        raise base.NotSupported("flat parameter layout fields (_numels_with_padding)")
    missing = [f for f in fields if not hasattr(flat, f)]
    assert not missing, f"{ctx.where()} {strategy}: the flat parameter records no {missing}"
    numels = [35, 7, 21, 3]
    segments, *_ = layout_rule(numels, ctx.world_size, ctx.rank, 4 if orig else 0)
    got = list(flat._numels_with_padding)
    assert got == segments, f"{ctx.where()} _numels_with_padding {got}, expected {segments}"
    total = sum(segments)
    chunk = math.ceil(total / ctx.world_size) if sharded else total
    expect = {
        "_unpadded_unsharded_size": torch.Size([total]),
        "_padded_unsharded_size": torch.Size([chunk * ctx.world_size if sharded else total]),
        "_sharded_size": torch.Size([chunk]),
    }
    for field, want in expect.items():
        if field not in fields:
            continue
        value = getattr(flat, field)
        assert value == want, f"{ctx.where()} {strategy}: {field} {value}, expected {want}"


@check(area="layout", requires=REQUIRES | {base.AUTO_WRAP}, world_sizes=(2,))
def orig_params_sharded_numels(ctx):
    """R38: ``use_orig_params=True``, FULL_SHARD at ws 2, one unit over parameters of numels 35,
    7, 21, 3: between unshards each original parameter (``named_parameters()``) holds its part of
    this rank's shard, 1-D, with ``numel_in_shard`` elements of the R10 layout and 0 elements when
    none of it lies in the shard; so after construction and again after a training step. After
    the backward a parameter with 0 elements here (at rank 0, the bias of 7 whose range starts
    exactly where rank 1's shard does) has ``.grad`` None, the others a gradient (R1)."""
    from conformance.checks.fsdp1.wrapper_api import layout_rule

    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(ctx.device)
    names = [n for n, _ in oracle.named_parameters()]
    numels = [p.numel() for p in oracle.parameters()]
    model = ctx.impl.shard(oracle, ctx, plan=[("", {})], use_orig_params=True)
    _, _, _, infos, _ = layout_rule(numels, ctx.world_size, ctx.rank, 4)
    want = {n: (info[2] if info[0] else 0) for n, info in zip(names, infos)}
    assert 0 in want.values(), f"{ctx.where()} test setup: every parameter is on this rank"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def check_now(when: str) -> None:
        got = {ctx.impl.clean_fqn(n): p for n, p in model.named_parameters()}
        for name, n in want.items():
            assert name in got, f"{ctx.where()} {when}: {name} missing ({sorted(got)})"
            p = got[name]
            assert p.dim() == 1 and p.numel() == n, (
                f"{ctx.where()} {when}: {name} has shape {tuple(p.shape)}, expected ({n},) "
                f"(its part of this rank's shard)"
            )

    check_now("after construction")
    model(torch.randn(2, 5, device=ctx.device)).sum().backward()
    grads = {ctx.impl.clean_fqn(n): p.grad for n, p in model.named_parameters()}
    for name, n in want.items():  # R1: no element here (also one touching the shard): no .grad
        grad = grads[name]
        assert (grad is None) == (n == 0), (
            f"{ctx.where()} after backward: {name} holds {n} element(s) here but its .grad is "
            f"{None if grad is None else tuple(grad.shape)}; expected "
            f"{'None' if n == 0 else f'({n},)'}"
        )
    opt.step()
    check_now("after a training step")


# ------------------------------------------------------------------------------ dict outputs
class _DictInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)

    def forward(self, x):
        return {"h": self.lin(x)}


class _DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _DictInner()
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return {"out": self.head(torch.tanh(self.inner(x)["h"]))}


@check(area="training", requires={base.TRAINING}, world_sizes=(1, 2))
def dict_outputs_train(ctx):
    """R39: units (FSDP1) or fully_shard modules whose forwards return a dict of tensors (the
    nested one and the root) train as with a tensor output: backward reaches every unit through the dict's values, so two SGD steps
    on the same batch on every rank give the unsharded model's parameters."""
    from conformance.checks._shared.sd_models import full_params

    ctx.seed(0)
    oracle = _DictNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    ctx.seed(1)
    x = torch.randn(4, 5, device=ctx.device)
    for step in range(2):
        for m, opt in zip((model, oracle), opts):
            out = m(x)
            assert isinstance(out, dict), f"{ctx.where()} step {step}: output {type(out)}"
            out["out"].square().sum().backward()
            opt.step()
            opt.zero_grad()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"after 2 steps: {name}", got[name], ref, FP32["param"])


# ------------------------------------------------------------------------------ writeback
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def orig_params_data_replaced(ctx):
    """R40: ``use_orig_params=True``: when every rank replaces each original parameter's ``.data``
    (between iterations, outside forward) by a new tensor of the same shape holding 0.5, the
    next forward uses the new values: its output equals the unsharded model's with every
    parameter 0.5, and so do the full parameters afterwards."""
    from conformance.checks._shared.sd_models import full_params

    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("", {})], use_orig_params=True)
    ctx.seed(1)
    x = torch.randn(4, 5, device=ctx.device)
    model(x).sum().backward()  # one iteration first: the lazy init has run
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.full_like(p.data, 0.5)
        for p in oracle.parameters():
            p.fill_(0.5)
        got = model(x)
    assert_close(ctx, "forward after replacing .data", got, oracle(x).detach(), FP32["param"])
    full = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"after replacing .data: {name}", full[name], ref, FP32["param"])
