"""Area "state_dict": FSDP1 optimizer state dicts beyond S24's one-group Adam (S29-S33).

[Note: what an optimizer state dict carries through FSDP1]
S24 pins ``step`` and Adam's moments of an optimizer with one param group over flat parameters.
The state dict carries more, and each piece must come out (and go back in) as the unsharded
optimizer has it:
* several param groups (one per FSDP unit here: ``inner``'s and the root's), each with its own
  hyperparameters (``lr``, ``betas``, ``weight_decay``): the groups of ``optim_state_dict`` list
  the FQNs of their parameters and keep those hyperparameters;
* state entries that are not tensors (an int counter of a small Adam subclass, ``seen``) next to
  the 0-dim ``step`` and the moments: the value the unsharded optimizer has, per parameter;
* with ``use_orig_params=True`` a frozen parameter (``inner.weight``, before ``inner.bias`` in
  its unit) has no state in the unsharded optimizer, so none in the dict, while the parameters
  after it in its unit have theirs; the flat parameter's padding (``head``'s 21 elements at world
  size 2: one element on rank 1) never reaches a parameter's state;
* a parameter with two FQNs (``b.weight is a.weight`` across two modules) has its state once, under
  one of them, and it loads back; a parameter FSDP does not manage (``ignored_modules``) keeps
  its plain state.
``optim_state_dict_to_load`` of such a dict (FULL, FULL ``rank0_only`` with the others passing
``{}``, SHARDED) into a freshly built model and optimizer gives back the same state, and one more
step gives the unsharded model's parameters. A FULL dict in which some parameters of one flat
parameter have state and others none (S35) is ``optim_stateless.py``'s. A FULL
dict whose parameters of one flat parameter have different state names (one lacks
``exp_avg_sq``) is refused with ValueError ("Differing optimizer state names"). Under LOCAL (``LocalOptimStateDictConfig``) ``optim_state_dict`` gives
the SHARDED form's values, on the CPU with ``offload_to_cpu=True``.

Every rank feeds the same global batch here, so the average FSDP takes over ranks is the unsharded
model's gradient and even a module FSDP ignores (not reduced) trains as the oracle does.

[Note: CPU offload aliasing]
torch 2.13 gathers each state of a ``use_orig_params=True`` unit (``exp_avg``, then
``exp_avg_sq``) into one reused buffer and keeps views of it when ``offload_to_cpu=True`` (the
default of ``FullOptimStateDictConfig``): on a GPU ``.cpu()`` copies, on the CPU it is a no-op, so
every tensor state of the FULL dict ends up holding the last one gathered (``exp_avg`` equals
``exp_avg_sq``). The FULL dicts here are taken with ``offload_to_cpu=False`` (S26: the values
must not depend on it), which copies.

[Note: rank0_only and non-tensor state]
``optim_state_dict_to_load`` under FULL ``rank0_only`` moves rank 0's state entries to the CPU
with ``.cpu()`` and fails on an int entry (AttributeError) in torch 2.13, so the ``rank0_only``
cases use plain Adam state (``step`` and the moments) only.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.optim_state import STATE_TOL
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, SharedWeightNet, full_params
from conformance.registry import check

REQUIRES = {base.FSDP1_OPTIM_STATE_DICT, base.FSDP1_API, base.FLAT_PARAM, base.TRAINING}
STEPS = 2
PLAN = [("inner", {}), ("", {})]
GROUP_OPTIONS = (  # inner's group, then the root's
    {"lr": 1e-2, "betas": (0.9, 0.99)},
    {"lr": 5e-3, "weight_decay": 0.1},
)


class CountingAdam(torch.optim.Adam):
    """Adam that also counts, per parameter, the steps that updated it: ``state[p]["seen"]``, a
    plain int (a state entry that is not a tensor)."""

    def __init__(self, params, count=True):
        super().__init__(params)
        self.count = count

    def step(self, closure=None):
        out = super().step(closure)
        if not self.count:
            return out
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["seen"] = int(self.state[p].get("seen", 0)) + 1
        return out


class IgnoredNet(InnerHeadNet):
    """InnerHeadNet with a ``side`` Linear(3, 3) after the head, which FSDP is told to ignore."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(3, 3)

    def forward(self, x):
        return self.side(super().forward(x))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation and offload warnings
        return fn(*args, **kwargs)


def _build(ctx, model_kind, orig_params):
    """(oracle, sharded model); the same values (seed 0), ``inner.weight`` frozen when
    ``orig_params`` (a unit of mixed requires_grad needs ``use_orig_params=True``)."""
    ctx.seed(0)
    if model_kind == "tied":
        oracle = SharedWeightNet(0).to(ctx.device)
        plan, options = [("", {})], {}
    elif model_kind == "ignored":
        oracle = IgnoredNet().to(ctx.device)
        plan, options = PLAN, {}
    else:
        oracle = InnerHeadNet().to(ctx.device)
        plan, options = PLAN, {}
        if orig_params and model_kind == "groups":  # "frozen_later": frozen after the steps
            oracle.inner.weight.requires_grad_(False)
    model = copy.deepcopy(oracle)
    if model_kind == "ignored":
        options["ignored_modules"] = [model.side]
    model = ctx.impl.shard(model, ctx, plan=plan, use_orig_params=orig_params, **options)
    return oracle, model


def _groups(params):
    """Two groups: the parameters whose name holds ``inner`` (its unit), then the rest."""
    params = [(n, p) for n, p in params if p.requires_grad]
    first = [p for n, p in params if "inner" in n]
    rest = [p for n, p in params if "inner" not in n]
    groups = [dict(params=first, **GROUP_OPTIONS[0]), dict(params=rest, **GROUP_OPTIONS[1])]
    return [g for g in groups if g["params"]]


def _step(ctx, model, opt, step):
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(ctx.world_size * 2, 4, generator=g).to(ctx.device)  # the global batch
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _freeze_later(ctx, model, model_kind):
    """``frozen_later``: ``inner.weight`` stops requiring grad once the optimizer holds it (its
    state stays, in the unsharded optimizer too)."""
    if model_kind != "frozen_later":
        return
    for name, p in model.named_parameters():
        if ctx.impl.clean_fqn(name) == "inner.weight":
            p.requires_grad_(False)


def _trained(ctx, model_kind="groups", orig_params=False, count=True):
    oracle, model = _build(ctx, model_kind, orig_params)
    oopt = CountingAdam(_groups(oracle.named_parameters()), count)
    opt = CountingAdam(_groups(model.named_parameters()), count)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    _freeze_later(ctx, oracle, model_kind)
    _freeze_later(ctx, model, model_kind)
    return oracle, oopt, model, opt


def _context(ctx, model, kind, rank0_only=False, offload=None):
    ns = ctx.impl.ns
    extra = {} if offload is None else {"offload_to_cpu": offload}
    if kind == "full":
        cfgs = (
            ns.StateDictType.FULL_STATE_DICT,
            ns.FullStateDictConfig(rank0_only=rank0_only),
            ns.FullOptimStateDictConfig(rank0_only=rank0_only, **extra),
        )
    elif kind == "sharded":
        cfgs = (
            ns.StateDictType.SHARDED_STATE_DICT,
            ns.ShardedStateDictConfig(),
            ns.ShardedOptimStateDictConfig(**extra),
        )
    else:
        cfgs = (
            ns.StateDictType.LOCAL_STATE_DICT,
            ns.LocalStateDictConfig(),
            ns.LocalOptimStateDictConfig(**extra),
        )
    return ns.FullyShardedDataParallel.state_dict_type(model, *cfgs)


def _osd(ctx, model, opt, kind, rank0_only=False, offload=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, model, kind, rank0_only, offload):
            return ctx.impl.ns.FullyShardedDataParallel.optim_state_dict(model, opt)


def _local(ctx, what, value):
    """This rank's tensor of a sharded state entry (a ShardedTensor's one local shard), or None."""
    assert hasattr(value, "local_shards"), (
        f"{ctx.where()} {what}: {type(value).__name__}, expected a ShardedTensor"
    )
    shards = value.local_shards()
    assert len(shards) <= 1, f"{ctx.where()} {what}: {len(shards)} local shards, expected 1"
    return shards[0].tensor if shards else None


def _state_fqns(oracle, oopt):
    """param -> its FQNs in the oracle (every name of a shared parameter)."""
    fqns = {}
    for name, p in oracle.named_parameters(remove_duplicate=False):
        fqns.setdefault(p, []).append(name)
    return fqns


def _assert_osd(ctx, osd, oracle, oopt, full, what):
    """``osd`` holds ``oopt``'s state and param groups under ``oracle``'s FQNs: one entry per
    parameter with state (under one of its FQNs), none for a parameter without; ``step``,
    ``seen`` equal, moments full (``full``) or this rank's dim-0 chunk; each group lists its
    parameters' FQNs and keeps its hyperparameters."""
    fqns = _state_fqns(oracle, oopt)
    state = osd.get("state", {})
    expected_keys = set()
    for p, names in fqns.items():
        if p not in oopt.state:
            for name in names:
                assert name not in state, (
                    f"{ctx.where()} {what}: {name} has state {sorted(state[name])}, expected none "
                    "(the unsharded optimizer has none for it)"
                )
            continue
        held = [n for n in names if n in state]
        assert len(held) == 1, (
            f"{ctx.where()} {what}: state under {held} for the parameter named {names}, expected "
            "exactly one of its FQNs"
        )
        expected_keys.add(held[0])
        mine, want = state[held[0]], oopt.state[p]
        assert sorted(mine) == sorted(want), (
            f"{ctx.where()} {what} {held[0]}: state names {sorted(mine)}, expected {sorted(want)}"
        )
        assert float(mine["step"]) == float(want["step"]), (
            f"{ctx.where()} {what} {held[0]}: step {mine['step']}, expected {want['step']}"
        )
        if "seen" in want:
            assert mine["seen"] == want["seen"] and not torch.is_tensor(mine["seen"]), (
                f"{ctx.where()} {what} {held[0]}: seen {mine['seen']!r}, expected the int "
                f"{want['seen']!r}"
            )
        for key, tol in STATE_TOL.items():
            label = f"{what} {held[0]}.{key}"
            if full:
                assert type(mine[key]) is torch.Tensor, (
                    f"{ctx.where()} {label}: {type(mine[key]).__name__}, expected a plain tensor"
                )
                assert_close(ctx, label, mine[key], want[key], tol)
                continue
            expected = chunk_of(want[key], 0, ctx.world_size, ctx.rank)
            local = _local(ctx, label, mine[key])
            if local is None:
                assert expected.numel() == 0, (
                    f"{ctx.where()} {label}: no local shard, expected {tuple(expected.shape)}"
                )
            else:
                assert_close(ctx, f"{label} (this rank's chunk)", local, expected, tol)
    assert set(state) == expected_keys, (
        f"{ctx.where()} {what}: state keys {sorted(state)}, expected {sorted(expected_keys)}"
    )
    groups = osd["param_groups"]
    assert len(groups) == len(oopt.param_groups), (
        f"{ctx.where()} {what}: {len(groups)} param groups, expected {len(oopt.param_groups)}"
    )
    for i, (got, want) in enumerate(zip(groups, oopt.param_groups)):
        names = sorted(n for p in want["params"] for n in fqns[p] if n in got["params"])
        want_names = sorted({fqns[p][0] for p in want["params"]})
        assert sorted(got["params"]) == names and len(names) == len(want_names), (
            f"{ctx.where()} {what}: param group {i} lists {sorted(got['params'])}, expected the "
            f"FQNs of {want_names}"
        )
        for key in ("lr", "betas", "weight_decay"):
            assert got[key] == want[key], (
                f"{ctx.where()} {what}: param group {i} {key} = {got[key]!r}, expected "
                f"{want[key]!r}"
            )


def _load_and_step(ctx, oracle, oopt, model, osd, kind, rank0_only, model_kind, orig_params):
    """Load ``osd`` (and the model's values) into a freshly built model and optimizer; check the
    state read back (FULL, every rank) and the parameters one step later."""
    msd = ctx.impl.state_dict(model, "full")
    _, fresh = _build(ctx, model_kind, orig_params)
    ctx.impl.load_state_dict(fresh, msd, "full")
    fopt = CountingAdam(_groups(fresh.named_parameters()), oopt.count)
    _freeze_later(ctx, fresh, model_kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, fresh, kind, rank0_only):
            flat = ctx.impl.ns.FullyShardedDataParallel.optim_state_dict_to_load(
                fresh, fopt, osd if osd else {}
            )
    fopt.load_state_dict(flat)
    back = _osd(ctx, fresh, fopt, "full", offload=False)  # see [Note: CPU offload aliasing]
    _assert_osd(ctx, back, oracle, oopt, True, f"after the {kind} load")
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    got = full_params(ctx, fresh)
    for name, ref in oracle.named_parameters():
        if name in got:
            assert_close(
                ctx, f"{name} one step after the {kind} load", got[name], ref, FP32["param"]
            )
    if model_kind == "ignored":  # not managed by FSDP: the module's own parameters
        for name, ref in oracle.side.named_parameters():
            assert_close(
                ctx,
                f"side.{name} (ignored) one step after the load",
                fresh.side.get_parameter(name),
                ref,
                FP32["param"],
            )


CASES = {
    "full": {"kind": "full", "rank0_only": False, "orig_params": False},
    "full-rank0_only": {"kind": "full", "rank0_only": True, "orig_params": False},
    "sharded": {"kind": "sharded", "rank0_only": False, "orig_params": False},
    "full-orig_params": {"kind": "full", "rank0_only": False, "orig_params": True},
    "full-rank0_only-orig_params": {"kind": "full", "rank0_only": True, "orig_params": True},
    "sharded-orig_params": {"kind": "sharded", "rank0_only": False, "orig_params": True},
    "full-orig_params-frozen_later": {
        "kind": "full",
        "rank0_only": False,
        "orig_params": True,
        "model_kind": "frozen_later",
    },
}


@check(area=AREA, requires=REQUIRES, cases=CASES, world_sizes=(2,))
def fsdp1_optim_groups_round_trip(ctx, kind, rank0_only, orig_params, model_kind="groups"):
    """S29/S30: after two steps of an Adam (counting its steps in a non-tensor ``seen``) with two
    param groups of different hyperparameters, ``optim_state_dict`` gives the unsharded
    optimizer's state (FULL: full tensors, ``rank0_only`` on rank 0 only; SHARDED: this rank's
    chunks) and param groups; with ``use_orig_params=True`` the frozen ``inner.weight`` has no
    state (frozen after the steps: the state it had) and ``inner.bias`` after it has its own; loaded into a fresh model and optimizer the
    state reads back equal and one more step gives the unsharded model's parameters."""
    # a non-tensor entry only without rank0_only: see [Note: rank0_only and non-tensor state]
    oracle, oopt, model, opt = _trained(ctx, model_kind, orig_params, count=not rank0_only)
    osd = _osd(ctx, model, opt, kind, rank0_only, offload=False if kind == "full" else None)
    if rank0_only and ctx.rank != 0:
        assert not osd, f"{ctx.where()} rank0_only: expected {{}}, got keys {sorted(osd)}"
    else:
        _assert_osd(ctx, osd, oracle, oopt, kind == "full", f"optim_state_dict ({kind})")
    _load_and_step(ctx, oracle, oopt, model, osd, kind, rank0_only, model_kind, orig_params)


MODEL_CASES = {
    "tied": {"model_kind": "tied", "kind": "full"},
    "tied-sharded": {"model_kind": "tied", "kind": "sharded"},
    "ignored": {"model_kind": "ignored", "kind": "full"},
    "tied-orig_params": {"model_kind": "tied", "kind": "full", "orig_params": True},
}


@check(area=AREA, requires=REQUIRES, cases=MODEL_CASES, world_sizes=(2,))
def fsdp1_optim_shared_and_ignored(ctx, model_kind, kind, orig_params=False):
    """S31: a parameter with two FQNs (``SharedWeightNet``'s ``b.weight is a.weight``)
    has its state once, under one FQN, and a module FSDP ignores (``ignored_modules``) keeps its
    parameters' plain state; both load back through ``optim_state_dict_to_load`` (FULL and
    SHARDED) and one more step gives the unsharded model's parameters."""
    oracle, oopt, model, opt = _trained(ctx, model_kind, orig_params)
    osd = _osd(ctx, model, opt, kind, offload=False if kind == "full" else None)
    _assert_osd(ctx, osd, oracle, oopt, kind == "full", f"optim_state_dict ({kind})")
    _load_and_step(ctx, oracle, oopt, model, osd, kind, False, model_kind, orig_params)


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_differing_state_names(ctx):
    """S32: a FULL optimizer state dict in which ``inner.bias`` lacks ``exp_avg_sq`` while
    ``inner.weight`` (same flat parameter) has it is refused by ``optim_state_dict_to_load`` with
    ValueError "Differing optimizer state names"."""
    oracle, oopt, model, opt = _trained(ctx)
    osd = _osd(ctx, model, opt, "full")
    del osd["state"]["inner.bias"]["exp_avg_sq"]
    fopt = CountingAdam(_groups(model.named_parameters()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _context(ctx, model, "full"):
                ctx.impl.ns.FullyShardedDataParallel.optim_state_dict_to_load(model, fopt, osd)
    except ValueError as exc:
        assert "Differing optimizer state names" in str(exc), (
            f"{ctx.where()} ValueError {str(exc)[:160]!r}, expected 'Differing optimizer state "
            "names'"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict_to_load accepted inner.bias without exp_avg_sq next "
            "to inner.weight with it; expected ValueError"
        )


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_local_offload(ctx):
    """S33: under LOCAL_STATE_DICT with ``LocalOptimStateDictConfig(offload_to_cpu=True)``
    ``optim_state_dict`` gives the SHARDED form's state (this rank's chunks of the unsharded
    optimizer's, as ShardedTensors), every tensor on the CPU."""
    oracle, oopt, model, opt = _trained(ctx)
    osd = _osd(ctx, model, opt, "local", offload=True)
    _assert_osd(ctx, osd, oracle, oopt, False, "optim_state_dict (LOCAL, offload_to_cpu=True)")
    for name, state in osd["state"].items():
        for key in STATE_TOL:
            local = _local(ctx, f"{name}.{key}", state[key])
            if local is not None:
                assert local.device.type == "cpu", (
                    f"{ctx.where()} LOCAL offload_to_cpu=True: {name}.{key} on {local.device}, "
                    "expected the CPU"
                )
