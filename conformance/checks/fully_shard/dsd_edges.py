"""Area "fsdp2_state_dict": the less travelled paths of ``torch.distributed.checkpoint.state_dict``
(DSD) on a ``fully_shard`` model (P50-P55).

[Note: what DSD promises beyond the plain options]
* A compiler wrapper (``OptimizedModule``: what ``torch.compile`` and ``torch.compiler.disable``
  return for a module) prefixes every key of the module's own ``state_dict`` with ``_orig_mod.``;
  DSD's dicts are keyed by the unwrapped model's FQNs all the same, and load into a wrapped model
  (P50).
* A module's extra state (``get_extra_state``) is an entry ``<module>._extra_state`` holding that
  value, and loading passes the dict's entry to ``set_extra_state`` (P51).
* Optimizer dicts: a list of optimizers gets one dict holding every optimizer's state and groups,
  and loads back split per optimizer; an optimizer's own ``state_dict()`` (ids, not FQNs) loads
  too; an optimizer group without parameters keeps its options through the dict; a strict load of
  a dict lacking a trained parameter's state is refused naming it (P52).
* ``flatten_optimizer_state_dict=True`` round trips state nested two levels deep, a weight shared
  by two modules and a frozen parameter in the optimizer (P53).
* The patched methods (``_patch_model_state_dict`` / ``_patch_optimizer_state_dict``) make the
  model's and optimizer's own ``state_dict`` / ``load_state_dict`` the DSD ones (P54).
* ``set_model_state_dict`` takes ``{submodule: its own state dict}`` (deprecated); and the
  refusals: ``broadcast_from_rank0`` without ``full_state_dict``, ``optim_only`` without an
  optimizer, an empty model or optimizer dict under a strict load, a key naming ``_flat_param``
  (P55).

The oracle is the unsharded model (with its own optimizer, fed the same global batch on every
rank) or, for keys and values, the unsharded model's ``state_dict``; expected chunks come from
``_shared/rows.py``.
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks._shared.sd_models import SharedWeightNet
from conformance.checks.fully_shard.dsd_optim_groups import _assert_params, _step
from conformance.checks.fully_shard.dsd_optim_state import _assert_state
from conformance.checks.fully_shard.state_dict import PLAN, Net
from conformance.registry import check

AREA = "fsdp2_state_dict"
MODEL = {base.DCP_HELPERS, base.DTENSOR_PARAMS, base.FSDP2_API}
TRAIN = MODEL | {base.TRAINING}
STEPS = 2


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _plain(salt):
    return {k: v.detach().clone() for k, v in Net(salt).state_dict().items()}


def _sharded(ctx, salt=0, module=None):
    return ctx.impl.shard(
        module if module is not None else Net(salt).to(ctx.device), ctx, plan=PLAN
    )


def _assert_chunks(ctx, model, expected, what):
    """Each parameter of ``model`` holds this rank's chunk of ``expected[fqn]``."""
    for fqn, param in model.named_parameters():
        want = chunk_of(expected[fqn], 0, ctx.world_size, ctx.rank)
        assert torch.equal(param.to_local().detach().cpu(), want), (
            f"{ctx.where()} {fqn} {what}: local shard is not this rank's chunk of the loaded values"
        )


def _expect_raise(ctx, exc_type, pattern, what, fn):
    try:
        fn()
    except exc_type as exc:
        assert re.search(pattern, str(exc), re.S), (
            f"{ctx.where()} {what}: {exc_type.__name__} {str(exc)[:200]!r} does not match "
            f"{pattern!r}"
        )
    else:
        raise AssertionError(f"{ctx.where()} {what} was accepted; expected {exc_type.__name__}")


# ------------------------------------------------------------------------------ P50: wrapper
def _wrap(model):
    """The compiler wrapper around ``model`` (an ``OptimizedModule``; its forward runs eagerly)."""
    return torch.compiler.disable(model)


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_compiled_wrapper(ctx):
    """P50: around a sharded model in a compiler wrapper (whose own ``state_dict`` keys start
    with ``_orig_mod.``), ``get_model_state_dict`` (sharded and full) and
    ``get_optimizer_state_dict`` are keyed by the unwrapped model's FQNs with this rank's chunks /
    the full values / the unsharded Adam's state; ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` load such dicts into a fresh wrapped model, after which one more
    step gives the unsharded model's parameters; the full dict passed by rank 0 only (the others
    ``{}``) with ``broadcast_from_rank0=True`` gives every rank its chunks of it; a strict load of a sharded dict lacking
    ``lin2.bias`` is refused with RuntimeError naming it, and with ``strict=False`` the key keeps
    the model's own value."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    wrapped = _wrap(model)
    assert all(k.startswith("_orig_mod.") for k in wrapped.state_dict()), (
        f"{ctx.where()} precondition: the wrapper's own keys {sorted(wrapped.state_dict())}"
    )
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, wrapped, opt, step)
    plain = {k: v.detach().cpu().clone() for k, v in oracle.state_dict().items()}

    sharded = dsd.get_model_state_dict(wrapped)
    assert sorted(sharded) == sorted(plain), (
        f"{ctx.where()} wrapped model: keys {sorted(sharded)}, expected {sorted(plain)}"
    )
    for fqn, value in sharded.items():
        want = chunk_of(plain[fqn], 0, ctx.world_size, ctx.rank)
        assert_close(ctx, f"wrapped sharded {fqn}", value.to_local(), want, FP32["param"])
    full = dsd.get_model_state_dict(wrapped, options=dsd.StateDictOptions(full_state_dict=True))
    assert sorted(full) == sorted(plain), f"{ctx.where()} wrapped full keys {sorted(full)}"
    for fqn, value in full.items():
        assert_close(ctx, f"wrapped full {fqn}", value, plain[fqn], FP32["param"])
    osd = dsd.get_optimizer_state_dict(wrapped, opt)
    _assert_state(ctx, osd, oracle, oopt, False, "wrapped get_optimizer_state_dict")

    fresh = _wrap(_sharded(ctx, 3))
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    result = dsd.set_model_state_dict(fresh, sharded)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    dsd.set_optimizer_state_dict(fresh, fopt, osd)
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, "(wrapped) one step after the load")

    target = _wrap(_sharded(ctx, 3))
    bcast = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    source = dict(full) if ctx.rank == 0 else {}
    result = dsd.set_model_state_dict(target, source, options=bcast)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    _assert_chunks(ctx, target._orig_mod, plain, "after a broadcast_from_rank0 load (wrapped)")

    lacking = {
        k: v for k, v in dsd.get_model_state_dict(_sharded(ctx, 3)).items() if k != "lin2.bias"
    }
    target = _wrap(_sharded(ctx, 0))
    _expect_raise(
        ctx,
        RuntimeError,
        r"lin2\.bias",
        "strict load of a dict lacking lin2.bias into a wrapped model",
        lambda: dsd.set_model_state_dict(target, dict(lacking)),
    )
    target = _wrap(_sharded(ctx, 0))
    opts = dsd.StateDictOptions(strict=False)
    dsd.set_model_state_dict(target, dict(lacking), options=opts)
    expected = _plain(3)
    expected["lin2.bias"] = _plain(0)["lin2.bias"]
    _assert_chunks(ctx, target._orig_mod, expected, "after a strict=False load (wrapped)")


# -------------------------------------------------------------------------- P51: extra state
class _Tagged(nn.Linear):
    """A Linear(4, 10) whose extra state is a dict ``{"tag": ...}``."""

    def __init__(self, tag):
        super().__init__(4, 10)
        self.tag = tag

    def get_extra_state(self):
        return {"tag": self.tag}

    def set_extra_state(self, state):
        self.tag = state["tag"]


class _TaggedNet(Net):
    """Net whose ``lin1`` (the first child, so its extra state comes before ``lin2``'s entries)
    carries extra state."""

    def __init__(self, salt=0, tag="a"):
        super().__init__(salt)
        values = self.lin1.state_dict()
        self.lin1 = _Tagged(tag)
        self.lin1.load_state_dict(values, strict=False)


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_extra_state(ctx):
    """P51: a sharded model whose ``lin1`` has extra state: ``get_model_state_dict`` (sharded and
    full) holds ``lin1._extra_state`` equal to ``lin1.get_extra_state()`` next to the parameters'
    entries (this rank's chunks / full values); ``get_optimizer_state_dict`` still keys the state
    of every parameter (the unsharded Adam's) and loads into a fresh optimizer (one more step: the
    unsharded model's parameters); ``set_model_state_dict`` of another model's dict
    (sharded, and full with ``full_state_dict=True``) hands its extra state to
    ``set_extra_state`` and loads its parameters."""
    dsd = _dsd()
    oracle = _TaggedNet(1, "a").to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    plain = {k: v for k, v in oracle.state_dict().items() if not k.endswith("_extra_state")}
    keys = sorted([*plain, "lin1._extra_state"])
    for full in (False, True):
        sd = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=full))
        assert sorted(sd) == keys, f"{ctx.where()} full={full}: keys {sorted(sd)}, expected {keys}"
        assert sd["lin1._extra_state"] == {"tag": "a"}, (
            f"{ctx.where()} full={full}: lin1._extra_state {sd['lin1._extra_state']!r}, "
            "expected {'tag': 'a'}"
        )
        for fqn, want in plain.items():
            got = sd[fqn] if full else sd[fqn].to_local()
            want = (
                want.detach().cpu()
                if full
                else chunk_of(want.detach().cpu(), 0, ctx.world_size, ctx.rank)
            )
            assert torch.equal(got.detach().cpu(), want), f"{ctx.where()} full={full} {fqn}"
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = dsd.get_optimizer_state_dict(model, opt)
    _assert_state(ctx, osd, oracle, oopt, False, "extra state")
    fresh = _sharded(ctx, module=copy.deepcopy(oracle))
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_optimizer_state_dict(fresh, fopt, osd)
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, "(extra state) one step after the optimizer load")

    source = _sharded(ctx, module=_TaggedNet(3, "b").to(ctx.device))
    for full in (False, True):
        options = dsd.StateDictOptions(full_state_dict=full)
        target = _sharded(ctx, module=_TaggedNet(0, "a").to(ctx.device))
        given = dsd.get_model_state_dict(source, options=options)
        result = dsd.set_model_state_dict(target, given, options=options)
        assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
        assert target.lin1.tag == "b", (
            f"{ctx.where()} full={full}: after the load lin1.tag = {target.lin1.tag!r}, expected "
            "the dict's 'b'"
        )
        _assert_chunks(ctx, target, _plain(3), f"after loading a dict with extra state ({full=})")


# ------------------------------------------------------------------- P52: optimizer dict forms
def _step_all(ctx, model, opts, step):
    """``_step`` (the same global batch on every rank) with several optimizers."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(ctx.world_size * 2, 4, generator=g).to(ctx.device)
    (model(x) ** 2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _per_module(model):
    """Two Adams: lin1's parameters at lr 1e-2, lin2's at 5e-3."""
    return [
        torch.optim.Adam(model.lin1.parameters(), lr=1e-2),
        torch.optim.Adam(model.lin2.parameters(), lr=5e-3),
    ]


def _oracle_two_groups(oracle):
    """The unsharded equivalent of ``_per_module``: one Adam with the same two groups (Adam's
    update is per parameter)."""
    return torch.optim.Adam(
        [
            {"params": list(oracle.lin1.parameters()), "lr": 1e-2},
            {"params": list(oracle.lin2.parameters()), "lr": 5e-3},
        ]
    )


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_list(ctx):
    """P52: ``get_optimizer_state_dict(model, [opt1, opt2])`` (lin1's and lin2's Adams) gives one
    dict with both optimizers' groups (each listing its module's FQNs with its own ``lr``) and the
    unsharded Adam's state for every parameter; ``set_optimizer_state_dict`` of it into fresh
    ``[opt1, opt2]`` gives each its own part (one more step: the unsharded model's parameters).
    An optimizer's own ``state_dict()`` (keyed by ids) loads through ``set_optimizer_state_dict``
    as it is. A dict lacking ``lin2.bias``'s state is refused under the default ``strict=True``
    with RuntimeError naming it; ``strict=False`` loads the rest."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt, opts = _oracle_two_groups(oracle), _per_module(model)
    for step in range(STEPS):
        _step_all(ctx, oracle, [oopt], step)
        _step_all(ctx, model, opts, step)
    osd = dsd.get_optimizer_state_dict(model, opts)
    _assert_state(ctx, osd, oracle, oopt, False, "two optimizers")
    groups = sorted((g["lr"], sorted(g["params"])) for g in osd["param_groups"])
    want = [(5e-3, ["lin2.bias", "lin2.weight"]), (1e-2, ["lin1.bias", "lin1.weight"])]
    assert groups == want, f"{ctx.where()} two optimizers: groups {groups}, expected {want}"
    msd = dsd.get_model_state_dict(model)

    fresh = _sharded(ctx, 3)
    fopts = _per_module(fresh)
    dsd.set_model_state_dict(fresh, dict(msd))
    dsd.set_optimizer_state_dict(fresh, fopts, osd)
    for fopt, module in zip(fopts, ("lin1", "lin2")):
        held = sorted(n for n, p in fresh.named_parameters() if p in fopt.state)
        assert held == [f"{module}.bias", f"{module}.weight"], (
            f"{ctx.where()} after the load, {module}'s optimizer holds state for {held}"
        )
    _step_all(ctx, oracle, [oopt], STEPS)
    _step_all(ctx, fresh, fopts, STEPS)
    _assert_params(ctx, fresh, oracle, "one step after loading two optimizers")

    # the optimizer's own (id-keyed) dict
    own = opts[1].state_dict()
    again = _sharded(ctx, 3)
    aopt = _per_module(again)[1]
    dsd.set_optimizer_state_dict(again, aopt, own)
    for name, p, q in zip(("weight", "bias"), model.lin2.parameters(), again.lin2.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            got, ref = aopt.state[q][key], opts[1].state[p][key]
            got = got.to_local() if hasattr(got, "to_local") else got
            ref = ref.to_local() if hasattr(ref, "to_local") else ref
            assert torch.equal(got, ref), (
                f"{ctx.where()} id-keyed load: lin2.{name} {key} differs from the saved one"
            )

    lacking = dsd.get_optimizer_state_dict(model, opts)
    del lacking["state"]["lin2.bias"]
    # (the dict shares its tensors with the optimizers' state, and an optimizer that loads a
    # dict keeps its ``step`` tensors, so compare with the values it holds now)
    saved = {k: float(v["step"]) for k, v in lacking["state"].items()}
    target = _sharded(ctx, 3)
    _expect_raise(
        ctx,
        RuntimeError,
        r"Missing optimizer state.*lin2\.bias",
        "strict load of an optimizer dict lacking lin2.bias",
        lambda: dsd.set_optimizer_state_dict(target, _per_module(target), copy.copy(lacking)),
    )
    topts = _per_module(target)
    dsd.set_optimizer_state_dict(target, topts, lacking, options=dsd.StateDictOptions(strict=False))
    for name, step in saved.items():
        p = target.get_parameter(name)
        opt = topts[0] if name.startswith("lin1") else topts[1]
        assert float(opt.state[p]["step"]) == step, (
            f"{ctx.where()} strict=False load: {name} step {opt.state[p]['step']}, expected "
            f"the dict's {step}"
        )


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_empty_group(ctx):
    """P52: an Adam with a second param group without parameters (``lr`` 0.5): the optimizer dict
    (sharded, and with ``full_state_dict=True``) lists that group with no FQNs and its ``lr``;
    loaded with the same options into a fresh optimizer whose empty group has ``lr`` 0.1, the
    empty group takes 0.5 and one more step gives the unsharded model's parameters. Two empty
    groups, or an empty group in one of several optimizers, are refused with ValueError
    ("zero parameters" / "multiple optimizers")."""
    dsd = _dsd()
    for full in (False, True):
        oracle = Net(0).to(ctx.device)
        model = _sharded(ctx, module=copy.deepcopy(oracle))
        oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        opt.add_param_group({"params": [], "lr": 0.5})
        for step in range(STEPS):
            _step_all(ctx, oracle, [oopt], step)
            _step_all(ctx, model, [opt], step)
        options = dsd.StateDictOptions(full_state_dict=full)
        osd = dsd.get_optimizer_state_dict(model, opt, options=options)
        groups = [(g["lr"], sorted(g["params"])) for g in osd["param_groups"]]
        names = sorted(n for n, _ in oracle.named_parameters())
        assert groups == [(1e-2, names), (0.5, [])], (
            f"{ctx.where()} full={full}: groups {groups}, expected {[(1e-2, names), (0.5, [])]}"
        )
        msd = dsd.get_model_state_dict(model)
        fresh = _sharded(ctx, 3)
        fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fopt.add_param_group({"params": [], "lr": 0.1})
        dsd.set_model_state_dict(fresh, msd)
        dsd.set_optimizer_state_dict(fresh, fopt, osd, options=options)
        assert fopt.param_groups[1]["lr"] == 0.5, (
            f"{ctx.where()} full={full}: the empty group's lr {fopt.param_groups[1]['lr']} after "
            "the load, expected the dict's 0.5"
        )
        _step_all(ctx, oracle, [oopt], STEPS)
        _step_all(ctx, fresh, [fopt], STEPS)
        _assert_params(ctx, fresh, oracle, f"one step after the load (full={full})")

    two = torch.optim.Adam(model.parameters(), lr=1e-2)
    two.add_param_group({"params": [], "lr": 0.5})
    two.add_param_group({"params": [], "lr": 0.2})
    twosd = dsd.get_optimizer_state_dict(model, two)
    _expect_raise(
        ctx,
        ValueError,
        r"zero parameters",
        "loading into an optimizer with two empty groups",
        lambda: dsd.set_optimizer_state_dict(model, two, twosd),
    )
    opts = _per_module(model)
    opts[0].add_param_group({"params": [], "lr": 0.5})
    listsd = dsd.get_optimizer_state_dict(model, opts)
    _expect_raise(
        ctx,
        ValueError,
        r"multiple optimizers",
        "loading two optimizers, one with an empty group",
        lambda: dsd.set_optimizer_state_dict(model, opts, listsd),
    )


# --------------------------------------------------------------------- P53: flattened edges
class _DeepSGD(torch.optim.SGD):
    """SGD keeping, per parameter it steps, ``info = {"stats": {"calls": n, "scale": n / 2}}``
    (state nested two levels below the entry)."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                calls = self.state[p].get("info", {}).get("stats", {}).get("calls", 0) + 1
                self.state[p]["info"] = {"stats": {"calls": calls, "scale": 0.5 * calls}}
        return out


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_flatten_edges(ctx):
    """P53: with ``flatten_optimizer_state_dict=True``: state nested two levels deep becomes
    ``state.<fqn>.info.stats.<key>`` and loads back as the unsharded optimizer's nested dict,
    while a frozen parameter in the optimizer gets no state entry (before the load and after);
    and on a model whose two modules share a weight the flattened Adam dict loads into a fresh
    model and optimizer, after which one more step gives the unsharded model's parameters."""
    dsd = _dsd()
    flat = dsd.StateDictOptions(flatten_optimizer_state_dict=True)
    oracle = Net(0).to(ctx.device)
    oracle.lin1.bias.requires_grad_(False)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt, opt = _DeepSGD(oracle.parameters()), _DeepSGD(model.parameters())
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = dsd.get_optimizer_state_dict(model, opt, options=flat)
    for name, p in oracle.named_parameters():
        if not p.requires_grad:
            assert not any(k.startswith(f"state.{name}.") for k in osd), (
                f"{ctx.where()} flattened: state entries for the frozen {name}"
            )
            continue
        for key, value in oopt.state[p]["info"]["stats"].items():
            got = osd.get(f"state.{name}.info.stats.{key}")
            assert got == value, (
                f"{ctx.where()} flattened: state.{name}.info.stats.{key} = {got!r}, expected "
                f"{value!r}"
            )
    fresh = _sharded(ctx, module=copy.deepcopy(oracle))
    fopt = _DeepSGD(fresh.parameters())
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=flat)
    for (name, p), fp in zip(oracle.named_parameters(), fresh.parameters()):
        want = oopt.state[p].get("info")
        got = fopt.state[fp].get("info")
        assert got == want, (
            f"{ctx.where()} after the flattened load: {name} info {got!r}, expected {want!r}"
        )

    oracle = SharedWeightNet(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("", {})])
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = dsd.get_optimizer_state_dict(model, opt, options=flat)
    msd = dsd.get_model_state_dict(model)
    fresh = ctx.impl.shard(SharedWeightNet(3).to(ctx.device), ctx, plan=[("", {})])
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_model_state_dict(fresh, msd)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=flat)
    for p, fp in zip(oracle.parameters(), fresh.parameters()):
        assert float(fopt.state[fp]["step"]) == float(oopt.state[p]["step"]), (
            f"{ctx.where()} shared weight, flattened load: step {fopt.state[fp]['step']}, "
            f"expected {oopt.state[p]['step']}"
        )
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, "(shared weight, flattened) one step after the load")


# ---------------------------------------------------------------------- P54: patched methods
@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_patched_methods(ctx):
    """P54: after ``_patch_model_state_dict(model=model, options=full_state_dict)`` (``model`` by
    keyword here, positionally for the fresh model below) the model's own
    ``state_dict()`` is ``get_model_state_dict``'s (full values under the unsharded FQNs) and its
    ``load_state_dict(full dict)`` leaves this rank's chunks of it; after
    ``_patch_optimizer_state_dict(model=model, optimizers=opt, options=full_state_dict)`` the
    optimizer's ``state_dict()`` is the FQN-keyed full DSD dict (the unsharded Adam's state) and a
    patched fresh optimizer's ``load_state_dict`` of it shards and restores the state (one more
    step: the unsharded parameters)."""
    dsd = _dsd()
    patched = set(dsd._patched_state_dict)
    try:
        oracle = Net(0).to(ctx.device)
        model = _sharded(ctx, module=copy.deepcopy(oracle))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
        for step in range(STEPS):
            _step(ctx, oracle, oopt, step)
            _step(ctx, model, opt, step)
        full = dsd.StateDictOptions(full_state_dict=True)
        dsd._patch_model_state_dict(model=model, options=full)
        sd = model.state_dict()
        plain = {k: v.detach().cpu() for k, v in oracle.state_dict().items()}
        assert sorted(sd) == sorted(plain), f"{ctx.where()} patched state_dict keys {sorted(sd)}"
        for fqn, value in sd.items():
            assert_close(ctx, f"patched state_dict {fqn}", value, plain[fqn], FP32["param"])
        dsd._patch_optimizer_state_dict(model=model, optimizers=(opt,), options=full)
        osd = opt.state_dict()

        def no_shards(name, key, value, full_value):
            raise AssertionError(f"{ctx.where()} patched {name}.{key}: expected a full tensor")

        assert_state(ctx, osd, oracle, oopt, True, "patched optimizer state_dict", no_shards)

        fresh = _sharded(ctx, 3)
        fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        dsd._patch_model_state_dict(fresh, options=full)
        dsd._patch_optimizer_state_dict(fresh, optimizers=fopt, options=full)
        fresh.load_state_dict(dict(sd))
        _assert_chunks(ctx, fresh, plain, "after the patched load_state_dict")
        fopt.load_state_dict(osd)
        _step(ctx, oracle, oopt, STEPS)
        _step(ctx, fresh, fopt, STEPS)
        _assert_params(ctx, fresh, oracle, "one step after the patched loads")
    finally:
        dsd._patched_state_dict.intersection_update(patched)


# ------------------------------------------------------- P55: submodule-keyed load, refusals
@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_submodule_keys_and_refusals(ctx):
    """P55: ``set_model_state_dict(model, {model.lin1: sd1, model.lin2: sd2})`` (deprecated,
    FutureWarning; each value keyed within its module) loads like the FQN-keyed dict; with
    ``strict=False`` and only ``{model.lin2: sd2}`` lin1 keeps its values and is reported missing.
    ``get_state_dict(model, [])`` gives the model dict and ``{}``; ``set_state_dict`` with an empty
    model dict loads only the optimizer and reports nothing missing. Refused: a strict load of
    ``{}`` (RuntimeError "model state_dict is empty"), an empty optimizer dict ("optim state_dict
    is empty"), ``set_state_dict`` with no optimizer and no model dict ("Optimizers are not
    passed"), ``broadcast_from_rank0`` without ``full_state_dict`` (ValueError), a key holding
    ``_flat_param`` (RuntimeError "<key> contains _flat_param", before any load), and
    ``get_state_dict(model, [])`` on ``fully_shard(nn.Sequential(nn.ReLU()))``, a model with no
    parameters or buffers (RuntimeError "model state_dict is empty")."""
    dsd = _dsd()
    src = dsd.get_model_state_dict(_sharded(ctx, 3))

    def within(module):
        return {k.split(".", 1)[1]: v for k, v in src.items() if k.startswith(f"{module}.")}

    target = _sharded(ctx, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        result = dsd.set_model_state_dict(
            target, {target.lin1: within("lin1"), target.lin2: within("lin2")}
        )
        assert any(issubclass(w.category, FutureWarning) for w in caught), (
            f"{ctx.where()} the module-keyed form gave no FutureWarning (deprecated)"
        )
        assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
        _assert_chunks(ctx, target, _plain(3), "after the submodule-keyed load")
        target = _sharded(ctx, 0)
        result = dsd.set_model_state_dict(
            target, {target.lin2: within("lin2")}, options=dsd.StateDictOptions(strict=False)
        )
    assert sorted(result.missing_keys) == ["lin1.bias", "lin1.weight"], (
        f"{ctx.where()} strict=False {{lin2: ...}}: missing {result.missing_keys}, expected lin1's"
    )
    expected = {
        **_plain(3),
        "lin1.weight": _plain(0)["lin1.weight"],
        "lin1.bias": _plain(0)["lin1.bias"],
    }
    _assert_chunks(ctx, target, expected, "after the strict=False {lin2: ...} load")

    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, model, opt, step)
    msd, none = dsd.get_state_dict(model, [])
    assert none == {} and sorted(msd) == sorted(_plain(0)), (
        f"{ctx.where()} get_state_dict(model, []): model keys {sorted(msd)}, optimizer {none!r}"
    )
    osd = dsd.get_optimizer_state_dict(model, opt)
    fresh = _sharded(ctx, 3)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    result = dsd.set_state_dict(fresh, fopt, model_state_dict={}, optim_state_dict=osd)
    assert not result.missing_keys and not result.unexpected_keys, (
        f"{ctx.where()} set_state_dict with an empty model dict: {result}"
    )
    steps = sorted(float(s["step"]) for s in fopt.state.values())
    assert steps == [float(STEPS)] * 4, f"{ctx.where()} optimizer steps after the load {steps}"
    _assert_chunks(ctx, fresh, _plain(3), "(untouched by an optimizer-only set_state_dict)")

    _expect_raise(
        ctx,
        RuntimeError,
        r"model state_dict is empty",
        "a strict load of {}",
        lambda: dsd.set_model_state_dict(model, {}),
    )
    _expect_raise(
        ctx,
        RuntimeError,
        r"optim state_dict is empty",
        "loading an empty optimizer dict",
        lambda: dsd.set_optimizer_state_dict(model, opt, {}),
    )
    _expect_raise(
        ctx,
        RuntimeError,
        r"Optimizers are not passed",
        "set_state_dict without optimizers",
        lambda: dsd.set_state_dict(model, [], model_state_dict={}, optim_state_dict={}),
    )
    _expect_raise(
        ctx,
        ValueError,
        r"full_state_dict must be True",
        "broadcast_from_rank0 without full",
        lambda: dsd.get_model_state_dict(
            model, options=dsd.StateDictOptions(broadcast_from_rank0=True)
        ),
    )
    _expect_raise(
        ctx,
        RuntimeError,
        r"lin1\._flat_param contains _flat_param",
        "a key holding _flat_param",
        lambda: dsd.set_model_state_dict(model, {"lin1._flat_param": torch.zeros(2)}),
    )
    empty = ctx.impl.ns.fully_shard(nn.Sequential(nn.ReLU()).to(ctx.device), mesh=ctx.mesh)
    _expect_raise(
        ctx,
        RuntimeError,
        r"model state_dict is empty",
        "get_state_dict(model, []) on a model with no parameters or buffers",
        lambda: dsd.get_state_dict(empty, []),
    )


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_full_extra_entry(ctx):
    """P52: a full optimizer dict (``full_state_dict=True``) of an ``amsgrad=True`` Adam loaded
    with the same option into a fresh plain Adam (which has no ``max_exp_avg_sq`` entry of its
    own): the optimizer takes the dict's options and every state entry, each moment this rank's
    chunk of the dict's, and one more step gives the unsharded amsgrad Adam's parameters."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2, amsgrad=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    full = dsd.StateDictOptions(full_state_dict=True)
    osd = dsd.get_optimizer_state_dict(model, opt, options=full)
    fresh = _sharded(ctx, module=copy.deepcopy(oracle))
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=full)
    assert fopt.param_groups[0]["amsgrad"] is True, f"{ctx.where()} amsgrad not loaded"
    for (name, p), fp in zip(oracle.named_parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            got = fopt.state[fp].get(key)
            assert got is not None and hasattr(got, "to_local"), (
                f"{ctx.where()} {name}.{key} after the full load: {type(got).__name__}, expected "
                "a DTensor of this rank's chunk"
            )
            want = chunk_of(oopt.state[p][key].detach().cpu(), 0, ctx.world_size, ctx.rank)
            assert_close(
                ctx, f"{name}.{key} after the full load", got.to_local(), want, FP32["param"]
            )
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, "one step after the full amsgrad load")
