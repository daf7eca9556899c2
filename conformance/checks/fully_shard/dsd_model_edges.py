"""Area "fsdp2_state_dict": the less travelled paths of ``torch.distributed.checkpoint.state_dict``
(DSD) model state dicts on a ``fully_shard`` model (P50, P51, P54, P55, P121). The helpers here
serve ``dsd_optim_edges.py`` too.

[Note: what DSD promises beyond the plain options]
* A compiler wrapper (``OptimizedModule``: what ``torch.compile`` and ``torch.compiler.disable``
  return for a module) prefixes every key of the module's own ``state_dict`` with ``_orig_mod.``;
  DSD's dicts are keyed by the unwrapped model's FQNs all the same, and load into a wrapped model
  (P50).
* A module's extra state (``get_extra_state``) is an entry ``<module>._extra_state`` holding that
  value, and loading passes the dict's entry to ``set_extra_state`` (P51).
* The patched methods (``_patch_model_state_dict`` / ``_patch_optimizer_state_dict``) make the
  model's and optimizer's own ``state_dict`` / ``load_state_dict`` the DSD ones (P54).
* ``set_model_state_dict`` takes ``{submodule: its own state dict}`` (deprecated); and the
  refusals: ``broadcast_from_rank0`` without ``full_state_dict``, ``optim_only`` without an
  optimizer, an empty model or optimizer dict under a strict load, a key naming ``_flat_param``
  (P55).
* ``_extra_state`` may only end a key: a child module registered under that name is refused by
  every entry point (P121).
The optimizer-dict edges (P52, P53) are in ``dsd_optim_edges.py``.

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


# ----------------------------------------------- P121: a submodule named like the extra state
@check(area=AREA, requires=MODEL, world_sizes=(1, 2))
def dsd_submodule_named_extra_state_refused(ctx):
    """P121: ``_extra_state`` names a module's extra state, so it may only end a key: on a sharded
    ``Net`` with a child ``Linear(3, 3)`` registered under the name ``_extra_state`` (its keys
    ``_extra_state.weight`` / ``_extra_state.bias`` in the model's own ``state_dict``),
    ``get_model_state_dict``, ``set_model_state_dict`` (of the model's own ``state_dict``) and
    ``get_optimizer_state_dict`` are each refused with RuntimeError "Expect `_extra_state` to be
    the last obj name"."""
    dsd = _dsd()
    net = Net(0).to(ctx.device)
    net.add_module("_extra_state", nn.Linear(3, 3).to(ctx.device))
    model = _sharded(ctx, module=net)
    own = model.state_dict()
    assert "_extra_state.weight" in own, f"{ctx.where()} own keys {sorted(own)}"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pattern = r"Expect `_extra_state` to be the last obj name"
    calls = {
        "get_model_state_dict": lambda: dsd.get_model_state_dict(model),
        "set_model_state_dict": lambda: dsd.set_model_state_dict(model, own),
        "get_optimizer_state_dict": lambda: dsd.get_optimizer_state_dict(model, opt),
    }
    for what, fn in calls.items():
        _expect_raise(ctx, RuntimeError, pattern, f"{what} (child named _extra_state)", fn)
