"""Area "state_dict": FSDP1's state-dict and optimizer-state refusals on paths no other case ran
(mixed state-dict types in one tree, optimizer-state API arguments: R99, R100), and optimizer
state of parameters that have none, or none but Python values (R102, R103).

The refusals are pinned as [Note: refusals are contracts] in ``conformance/checks/fsdp1/
init_errors.py`` says: exception type, a stable part of upstream's message, and where cheap that
the refused call changed nothing.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs, _nested
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check


# ------------------------------------------------------------------------------ R99
@check(area="state_dict", requires=REQUIRES, world_sizes=(1,))
def set_state_dict_type_mixed_refused(ctx):
    """R99: over ``FSDP(Sequential(FSDP(Linear(4, 4)), Linear(4, 4)))`` with the inner unit set
    to SHARDED_STATE_DICT, ``set_state_dict_type(root, FULL_STATE_DICT)`` raises AssertionError
    "All FSDP modules should have the same state_dict_type."; the inner unit is still
    SHARDED_STATE_DICT."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    model = _nested(ctx, fsdp)
    inner = model.module[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp.set_state_dict_type(inner, ns.StateDictType.SHARDED_STATE_DICT)
        expect_error(
            ctx,
            "set_state_dict_type(root, FULL) with the inner unit SHARDED",
            AssertionError,
            r"All FSDP modules should have the same state_dict_type",
            lambda: fsdp.set_state_dict_type(model, ns.StateDictType.FULL_STATE_DICT),
        )
        got = fsdp.get_state_dict_type(inner).state_dict_type
    assert got == ns.StateDictType.SHARDED_STATE_DICT, (
        f"{ctx.where()} after the refusal the inner unit's state_dict_type is {got}"
    )


# ------------------------------------------------------------------------------ R100
def _stepped(ctx):
    """One unit (``use_orig_params=False``) over ``Linear(4, 4)`` after one Adam step, its
    optimizer and its FULL ``optim_state_dict``."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    model = fsdp(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(_batch(ctx, 100)).square().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
    return model, opt, osd


def _rekey_bogus(ctx, fsdp, model, opt, osd):
    return fsdp.rekey_optim_state_dict(opt.state_dict(), "bogus", model)


def _optim_input_int(ctx, fsdp, model, opt, osd):
    return fsdp.full_optim_state_dict(model, opt, optim_input=5)


def _empty_state_to_load(ctx, fsdp, model, opt, osd):
    empty = {**osd, "state": {name: {} for name in osd["state"]}}
    return fsdp.optim_state_dict_to_load(model, opt, empty)


OPTIM_CASES = {
    "rekey_unknown_key_type": {
        "call": _rekey_bogus,
        "exc": AssertionError,
        "pattern": r"Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got bogus",
    },
    "optim_input_not_iterable": {
        "call": _optim_input_int,
        "exc": TypeError,
        "pattern": r"Optimizer input should be an iterable of Tensors or dicts, but got 5",
    },
    "empty_flat_state_to_load": {
        "call": _empty_state_to_load,
        "exc": RuntimeError,
        "pattern": r"(?s)The state of .*weight.*bias.* is empty",
    },
}


@check(
    area="state_dict",
    requires=REQUIRES | {base.FSDP1_OPTIM_STATE_DICT},
    cases=OPTIM_CASES,
    world_sizes=(1,),
)
def optim_state_api_refusals(ctx, call, exc, pattern):
    """R100: one unit (``use_orig_params=False``) over ``Linear(4, 4)`` after an Adam step:
    ``rekey_optim_state_dict(osd, "bogus", model)`` raises AssertionError "Expected
    optim_state_key_type to be PARAM_NAME or PARAM_ID, got bogus";
    ``full_optim_state_dict(model, opt, optim_input=5)`` TypeError "Optimizer input should be an
    iterable of Tensors or dicts, but got 5"; ``optim_state_dict_to_load`` of its FULL
    ``optim_state_dict`` with an empty state for ``weight`` and ``bias`` (the unit's only flat
    parameter) RuntimeError "The state of ... is empty" naming both. The optimizer's own state
    is unchanged by the refused call."""
    model, opt, osd = _stepped(ctx)
    before = {k: {f: v.clone() for f, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_error(
            ctx,
            call.__name__.strip("_"),
            exc,
            pattern,
            lambda: call(ctx, ctx.impl.ns.FullyShardedDataParallel, model, opt, osd),
        )
    after = opt.state_dict()["state"]
    assert sorted(after) == sorted(before) and all(
        torch.equal(after[k][f], v) for k, s in before.items() for f, v in s.items()
    ), f"{ctx.where()} the refused call changed the optimizer's state"


# ------------------------------------------------------------------------------ R102
class _UnusedChild(nn.Module):
    """``a(x)``: ``a`` and ``b`` are ``Linear(4, 4)``; ``b`` is never used."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


def _assert_state_equal(ctx, what, got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (
        f"{ctx.where()} {what}: optimizer state for {sorted(got)}, expected {sorted(want)}"
    )
    for name, entry in want.items():
        assert sorted(got[name]) == sorted(entry), (
            f"{ctx.where()} {what}: {name} has fields {sorted(got[name])}, expected {sorted(entry)}"
        )
        for field, value in entry.items():
            assert_close(ctx, f"{what}: {name}[{field!r}]", got[name][field], value, FP32["param"])


@check(
    area="state_dict",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_OPTIM_STATE_DICT},
    world_sizes=(2,),
)
def optim_state_without_entries(ctx):
    """R102: ``use_orig_params=True``, units ``b`` and the root over ``a(x)`` (``a``, ``b``
    ``Linear(4, 4)``, ``b`` unused), Adam over all parameters, one step on the same batch on
    every rank; the unsharded model and Adam alike. ``optim_state_dict_to_load`` of the FULL
    state made of the unsharded Adam's (keyed by name, ``param_groups`` from the model's FULL
    ``optim_state_dict``) with an empty state (``{}``) for ``a.weight``, loaded into the
    optimizer, leaves ``a.weight`` without state: a second step equals the unsharded Adam's
    with ``a.weight``'s state dropped (its parameters after it). The FULL ``optim_state_dict``
    taken after the first step has states for ``a.weight`` and ``a.bias`` only, equal to the
    unsharded Adam's (which has none for ``b``)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = _UnusedChild().to(ctx.device)
    plain = _UnusedChild().to(ctx.device)
    plain.load_state_dict(oracle.state_dict())
    plain.b = fsdp(plain.b, use_orig_params=True, **_kwargs(ctx))
    model = fsdp(plain, use_orig_params=True, **_kwargs(ctx))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    names = {p: n for n, p in oracle.named_parameters()}

    def step(salt):
        x = _batch(ctx, salt)
        model(x).square().mean().backward()
        oracle(x).square().mean().backward()
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        return {names[p]: {f: v.clone() for f, v in s.items()} for p, s in oopt.state.items()}

    want = step(102)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
        to_load = {"state": {**want, "a.weight": {}}, "param_groups": osd["param_groups"]}
        opt.load_state_dict(fsdp.optim_state_dict_to_load(model, opt, to_load))
    del oopt.state[oracle.a.weight]
    step(103)
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(
            ctx,
            f"{name} after a step with a.weight's state loaded empty",
            got[name],
            ref,
            FP32["param"],
        )
    _assert_state_equal(ctx, "optim_state_dict", osd["state"], want)


# ------------------------------------------------------------------------------ R103
class _CountingSGD(torch.optim.SGD):
    """SGD (no momentum: it keeps no tensor state) that counts, in its state, the steps each
    parameter took: ``state[p] == {"calls": n}``, a Python int and nothing else."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return loss


@check(
    area="state_dict",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_OPTIM_STATE_DICT},
    world_sizes=(2,),
)
def optim_state_non_tensor_only(ctx):
    """R103: one unit (``use_orig_params=True``) over ``Sequential(Linear(4, 4), Linear(4, 4))``
    and an SGD (no momentum) whose state per parameter is only the Python int ``calls`` (its
    step count): after one step, the FULL ``optim_state_dict`` is ``{"calls": 1}`` for each of
    the four parameters on every rank, as the unsharded optimizer's; after two more steps and
    ``optim_state_dict_to_load`` of that first dict loaded into the optimizer, it is that again."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    model = fsdp(plain, use_orig_params=True, **_kwargs(ctx))
    opt = _CountingSGD(model.parameters(), lr=0.1)
    want = {n: {"calls": 1} for n in ("0.weight", "0.bias", "1.weight", "1.bias")}

    def step(salt):
        model(_batch(ctx, salt)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(103)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
        assert osd["state"] == want, (
            f"{ctx.where()} optim_state_dict after one step: {osd['state']}, expected {want}"
        )
        step(104)
        step(105)
        opt.load_state_dict(fsdp.optim_state_dict_to_load(model, opt, osd))
        again = fsdp.optim_state_dict(model, opt)["state"]
    assert again == want, (
        f"{ctx.where()} optim_state_dict after loading the one-step dict: {again}, expected {want}"
    )
