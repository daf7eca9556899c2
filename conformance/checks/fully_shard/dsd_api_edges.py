"""Area "fsdp2_state_dict": contracts of the ``torch.distributed.checkpoint.state_dict`` (DSD) entry
points around a ``fully_shard`` model that no option names (P108-P111).

[Note: what the DSD entry points promise besides the dicts]
* The garbage collector: each getter and setter may switch it off while it works, and leaves
  ``gc.isenabled()`` as the caller had it, on or off, also when it raises (P108).
* A ``DistributedDataParallel`` inside the model (here: a replicated head beside a sharded
  encoder) adds ``module.`` to its parameters' own ``state_dict`` keys; DSD's dicts drop it (the
  keys are the unwrapped model's FQNs) and load back into the wrapped module (P109).
* A full-state-dict load copies into the model's parameters unless a tensor of the model sits on
  ``meta`` (then it assigns the loaded tensors); only tensors of dim > 0 count, so a 0-dim ``meta``
  buffer leaves the parameters the same objects and an optimizer built before still drives them
  (P110).
* Compiler wrappers nested (a wrapped submodule inside a wrapped model) put ``_orig_mod.`` at
  each level of the own keys; DSD's keys are still the unwrapped FQNs, whatever the parameters
  are called, a parameter named ``_orig_mod`` included (P111; torch 2.13 refuses that one:
  "An unexpected key, ... exists").

The oracle is the unsharded ``Net`` (``_Outer`` for P111) (its ``state_dict`` for keys and values, expected chunks from
``_shared/rows.py``; for training, the unsharded model fed the same global batch on every rank).
"""

from __future__ import annotations

import gc
import warnings

import torch
from torch import nn

from conformance.checks._shared.models import distinct_values
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.dsd_model_edges import (
    AREA,
    TRAIN,
    _assert_chunks,
    _dsd,
    _expect_raise,
    _plain,
    _sharded,
    _wrap,
)
from conformance.checks.fully_shard.dsd_optim_groups import _assert_params, _step
from conformance.checks.fully_shard.state_dict import Net
from conformance.registry import check


# ------------------------------------------------------------------------------ P108: gc state
@check(area=AREA, requires=TRAIN, world_sizes=(1, 2))
def dsd_keeps_gc_state(ctx):
    """P108: with the garbage collector enabled, and again with it disabled, each of
    ``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict``,
    ``set_model_state_dict``, ``set_optimizer_state_dict`` and ``set_state_dict`` (on a sharded
    ``Net`` and its Adam after one step) returns with ``gc.isenabled()`` as it was before the call,
    and so does a refused strict load of ``{}`` (RuntimeError); the getters' model dict is keyed
    like the unsharded model's ``state_dict``."""
    dsd = _dsd()
    model = _sharded(ctx, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(ctx, model, opt, 0)
    keys = sorted(_plain(0))
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()

            def after(what, enabled=enabled):
                assert gc.isenabled() is enabled, (
                    f"{ctx.where()} {what} with the garbage collector "
                    f"{'enabled' if enabled else 'disabled'}: gc.isenabled() is "
                    f"{gc.isenabled()} afterwards"
                )

            msd = dsd.get_model_state_dict(model)
            after("get_model_state_dict")
            assert sorted(msd) == keys, f"{ctx.where()} get_model_state_dict keys {sorted(msd)}"
            osd = dsd.get_optimizer_state_dict(model, opt)
            after("get_optimizer_state_dict")
            both, _ = dsd.get_state_dict(model, opt)
            after("get_state_dict")
            assert sorted(both) == keys, f"{ctx.where()} get_state_dict keys {sorted(both)}"
            dsd.set_model_state_dict(model, msd)
            after("set_model_state_dict")
            dsd.set_optimizer_state_dict(model, opt, osd)
            after("set_optimizer_state_dict")
            dsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            after("set_state_dict")
            _expect_raise(
                ctx,
                RuntimeError,
                r"model state_dict is empty",
                "a strict load of {}",
                lambda: dsd.set_model_state_dict(model, {}),
            )
            after("a refused set_model_state_dict")
    finally:
        (gc.enable if was else gc.disable)()


# ------------------------------------------------------------------ P109: DDP inside the model
def _hybrid(ctx, salt):
    """``Net(salt)`` with ``lin1`` sharded (its own unit) and ``lin2`` replicated by DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = ctx.impl.shard(Net(salt).to(ctx.device), ctx, plan=[("lin1", {})])
    model.lin2 = DDP(model.lin2)
    return model


def _assert_hybrid(ctx, model, expected, what):
    """lin1 holds this rank's chunks of ``expected``, the DDP-wrapped lin2 its full values."""
    for name in ("weight", "bias"):
        want = chunk_of(expected[f"lin1.{name}"], 0, ctx.world_size, ctx.rank)
        got = model.lin1.get_parameter(name).to_local().detach().cpu()
        assert torch.equal(got, want), f"{ctx.where()} lin1.{name} {what}: not this rank's chunk"
        got = model.lin2.module.get_parameter(name).detach().cpu()
        assert torch.equal(got, expected[f"lin2.{name}"]), (
            f"{ctx.where()} lin2.{name} (DDP-wrapped) {what}: not the loaded values"
        )


@check(area=AREA, requires=TRAIN, world_sizes=(1, 2))
def dsd_ddp_inside_model(ctx):
    """P109: a ``Net`` whose ``lin1`` is sharded and whose ``lin2`` is wrapped in
    ``DistributedDataParallel`` (own ``state_dict`` keys ``lin2.module.*``):
    ``get_model_state_dict`` is keyed by the unsharded model's FQNs (``lin2.weight``, no
    ``module.``) with lin1's chunks and lin2's values, and with ``full_state_dict=True`` the full
    values; ``set_model_state_dict`` of another such model's dict, and of the unsharded
    ``Net(3)``'s plain dict with ``full_state_dict=True``, reports no missing or unexpected key
    and leaves lin1 this rank's chunks and lin2 the values of ``Net(3)``; one SGD step after the
    load (global batch on every rank) gives the unsharded ``Net(3)``'s step."""
    dsd = _dsd()
    model = _hybrid(ctx, 0)
    own = sorted(model.state_dict())
    assert "lin2.module.weight" in own, f"{ctx.where()} precondition: own keys {own}"
    plain = _plain(0)
    sharded = dsd.get_model_state_dict(model)
    assert sorted(sharded) == sorted(plain), (
        f"{ctx.where()} get_model_state_dict keys {sorted(sharded)}, expected {sorted(plain)}"
    )
    for fqn, value in sharded.items():
        if fqn.startswith("lin1."):  # sharded: this rank's chunk
            value, want = value.to_local(), chunk_of(plain[fqn], 0, ctx.world_size, ctx.rank)
        else:  # replicated: the full value
            want = plain[fqn]
        assert torch.equal(value.detach().cpu(), want), (
            f"{ctx.where()} get_model_state_dict {fqn}: not the model's chunk / value"
        )
    full = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=True))
    assert sorted(full) == sorted(plain), f"{ctx.where()} full keys {sorted(full)}"
    for fqn, value in full.items():
        assert torch.equal(value.detach().cpu(), plain[fqn]), f"{ctx.where()} full {fqn}"

    given = dsd.get_model_state_dict(_hybrid(ctx, 3))
    target = _hybrid(ctx, 0)
    result = dsd.set_model_state_dict(target, given)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    _assert_hybrid(ctx, target, _plain(3), "after loading a sharded dict")
    target = _hybrid(ctx, 0)
    options = dsd.StateDictOptions(full_state_dict=True)
    result = dsd.set_model_state_dict(target, _plain(3), options=options)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    _assert_hybrid(ctx, target, _plain(3), "after loading the unsharded model's dict (full)")

    oracle = Net(3).to(ctx.device)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    opt = torch.optim.SGD(target.parameters(), lr=0.1)
    _step(ctx, oracle, oopt, 0)
    _step(ctx, target, opt, 0)
    for fqn, ref in oracle.named_parameters():
        module, name = fqn.split(".")
        param = getattr(target, module)
        param = (param.module if module == "lin2" else param).get_parameter(name)
        got = param.detach().full_tensor() if module == "lin1" else param.detach()
        assert_close(ctx, f"{fqn} one step after the load", got, ref, FP32["param"])


# ------------------------------------------------------------ P110: a 0-dim meta buffer
@check(area=AREA, requires=TRAIN, world_sizes=(1, 2))
def dsd_full_load_zero_dim_meta_buffer(ctx):
    """P110: a sharded ``Net`` with a 0-dim buffer ``s`` registered on ``meta`` (after sharding,
    on the root): ``set_model_state_dict`` of ``Net(3)``'s plain dict plus ``s`` with
    ``full_state_dict=True`` reports no missing or unexpected key, keeps every registered
    parameter the same object, and leaves this rank's chunks of ``Net(3)``; an SGD built over the
    parameters before the load then steps them like the unsharded ``Net(3)``'s SGD (global batch
    on every rank)."""
    dsd = _dsd()
    model = _sharded(ctx, 0)
    model.register_buffer("s", torch.empty((), device="meta"))
    before = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = {**_plain(3), "s": torch.tensor(0.5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # copying into a meta buffer is a no-op, with a warning
        result = dsd.set_model_state_dict(
            model, source, options=dsd.StateDictOptions(full_state_dict=True)
        )
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    for fqn, param in model.named_parameters():
        assert param is before[fqn], (
            f"{ctx.where()} {fqn}: a new Parameter object after the full load (assigned); a "
            "0-dim meta buffer must not make the load assign"
        )
    _assert_chunks(ctx, model, _plain(3), "after the full load beside a 0-dim meta buffer")
    oracle = Net(3).to(ctx.device)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    _step(ctx, oracle, oopt, 0)
    _step(ctx, model, opt, 0)
    _assert_params(ctx, model, oracle, "one step (optimizer built before the load)")


# ------------------------------------------------------- P111: nested compiler wrappers
class _Inner(nn.Module):
    """``lin`` = Linear(4, 10) and a (10,) parameter registered under ``name``."""

    def __init__(self, name):
        super().__init__()
        self.lin = nn.Linear(4, 10)
        self.register_parameter(name, nn.Parameter(torch.ones(10)))
        self.pname = name

    def forward(self, x):
        return self.lin(x) * getattr(self, self.pname)


class _Outer(nn.Module):
    """``a`` = ``_Inner``, ``b`` = Linear(10, 3); distinct values from ``salt``."""

    def __init__(self, name, salt):
        super().__init__()
        self.a = _Inner(name)
        self.b = nn.Linear(10, 3)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(distinct_values(tuple(p.shape), salt * 10 + i) / 1000.0)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _nested(ctx, name, salt):
    """``_Outer`` sharded (units ``a`` and the root), ``a`` and the root each in a compiler
    wrapper: the wrapped model and ``{unwrapped FQN: registered parameter}``."""
    outer = ctx.impl.shard(_Outer(name, salt).to(ctx.device), ctx, plan=[("a", {}), ("", {})])
    params = dict(outer.named_parameters())
    outer.a = _wrap(outer.a)
    return _wrap(outer), params


@check(
    area=AREA,
    requires=TRAIN,
    world_sizes=(1, 2),
    cases={"plain-name": {"name": "scale"}, "named-orig-mod": {"name": "_orig_mod"}},
)
def dsd_nested_compiled_wrappers(ctx, name):
    """P111: a sharded model in a compiler wrapper whose submodule ``a`` (its own unit) is in
    another, ``a`` holding ``lin`` and a (10,) parameter named ``scale`` (case plain-name) or
    ``_orig_mod`` (case named-orig-mod, the wrapper's own attribute name): the model's own keys
    are ``_orig_mod.a._orig_mod.<name>`` etc.; ``get_model_state_dict`` is keyed by the unwrapped
    model's FQNs (``a.<name>``, ``a.lin.*``, ``b.*``) with this rank's chunks, and
    ``set_model_state_dict`` of another such model's dict into a fresh one reports no missing or
    unexpected key and leaves this rank's chunks of the loaded values."""
    dsd = _dsd()
    model, params = _nested(ctx, name, 0)
    own = sorted(model.state_dict())
    assert f"_orig_mod.a._orig_mod.{name}" in own, f"{ctx.where()} precondition: own keys {own}"

    def plain(salt):
        return {k: v.detach().clone() for k, v in _Outer(name, salt).state_dict().items()}

    expected = plain(0)
    sd = dsd.get_model_state_dict(model)
    assert sorted(sd) == sorted(expected), (
        f"{ctx.where()} get_model_state_dict keys {sorted(sd)}, expected {sorted(expected)}"
    )
    for fqn, value in sd.items():
        want = chunk_of(expected[fqn], 0, ctx.world_size, ctx.rank)
        assert torch.equal(value.to_local().detach().cpu(), want), f"{ctx.where()} {fqn}"

    source, _ = _nested(ctx, name, 3)
    given = dsd.get_model_state_dict(source)
    target, params = _nested(ctx, name, 0)
    result = dsd.set_model_state_dict(target, given)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    loaded = plain(3)
    for fqn, param in params.items():
        want = chunk_of(loaded[fqn], 0, ctx.world_size, ctx.rank)
        assert torch.equal(param.to_local().detach().cpu(), want), (
            f"{ctx.where()} {fqn} after the load: not this rank's chunk of the loaded values"
        )
