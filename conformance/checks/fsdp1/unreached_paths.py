"""Area "fsdp1_runtime": FSDP1 behaviour on code paths no other case ran: a backward inside
``summon_full_params``, optimizer-state keys of mixed types, tied parameters converted or replaced
(R90-R93).

[Note: paths no other case reaches]
* A backward through a unit while it is inside ``summon_full_params`` is refused with ValueError
  saying the unit is expected to be IDLE but is in ``SUMMON_FULL_PARAMS`` (R90).
* ``rekey_optim_state_dict`` leaves a state already keyed as asked unchanged, and refuses one
  whose keys are not all parameter names or all ids, naming the keys (R91).
* ``model.double()`` keeps a tie between two original parameters of one unit
  (``use_orig_params=True``): both names give one float64 parameter, and the model trains as the
  unsharded one converted alike (R92).
* Replacing one of two tied original parameters of a unit with a new parameter is refused at the
  next forward with NotImplementedError "Changing shared parameters is not supported yet" (R93).
"""

from __future__ import annotations

import copy
import os
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks.fsdp1.flat_param_edges import FP64
from conformance.checks.fsdp1.training import assert_params_equal_oracle
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _global_batch(ctx, salt: int, dtype=torch.float32) -> torch.Tensor:
    """``ws * B`` samples of 4 features, the same on every rank."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(ctx.world_size * B, 4, generator=g, dtype=dtype).to(ctx.device)


class _ChildHead(nn.Module):
    """head(tanh(child(x))): ``child`` a ``Linear(4, 4)``, ``head`` a ``Linear(4, 2)``."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.child(x)))


# ------------------------------------------------------------------------------ R90
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def backward_inside_summon_refused(ctx):
    """R90: units ``child`` and the root over ``head(tanh(child(x)))``; after a forward (the same
    batch on every rank), a backward of its output run inside ``summon_full_params(model.child)``
    raises on every rank ValueError "expected to be in states [...IDLE...] but current state is
    ...SUMMON_FULL_PARAMS"; after the context exits, a forward still equals the unsharded
    model's."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = _ChildHead().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("child", {}), ("", {})])
    x = _global_batch(ctx, 90)
    out = model(x)

    def backward_in_summon():
        with fsdp.summon_full_params(model.module.child):
            out.sum().backward()

    expect_error(
        ctx,
        "backward inside summon_full_params(child)",
        ValueError,
        r"(?s)expected to be in states.*IDLE.*current state is.*SUMMON_FULL_PARAMS",
        backward_in_summon,
    )
    with torch.no_grad():
        assert_close(ctx, "forward after the refused backward", model(x), oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R91
def _rekey(fsdp, osd, key_type, model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp.rekey_optim_state_dict(osd, key_type, model)


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_OPTIM_STATE_DICT},
    world_sizes=(1, 2),
)
def rekey_mixed_keys_refused(ctx):
    """R91: the FULL ``optim_state_dict`` of one unit over ``Sequential(Linear(4, 4), Linear(4,
    2))`` after an Adam step (keyed by the four parameter names), and the same rekeyed to
    ``PARAM_ID``: ``rekey_optim_state_dict`` (with the unwrapped model) to the key type a state
    already has gives that state's keys and values unchanged. With one more state under a key that
    is not a parameter name, the int ``7`` or the float ``0.5``, it raises ValueError "Invalid
    parameter keys" naming every key, to ``PARAM_ID`` and to ``PARAM_NAME`` alike."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    by_id_type, by_name_type = ns.OptimStateKeyType.PARAM_ID, ns.OptimStateKeyType.PARAM_NAME
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(plain), ctx)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(_global_batch(ctx, 91)).square().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
    names = sorted(osd["state"])
    assert names == ["0.bias", "0.weight", "1.bias", "1.weight"], (
        f"{ctx.where()} test setup: optim_state_dict keys {names}"
    )
    by_id = _rekey(fsdp, osd, by_id_type, plain)
    assert sorted(by_id["state"]) == [0, 1, 2, 3], (
        f"{ctx.where()} test setup: rekeyed to PARAM_ID, keys {sorted(by_id['state'])}"
    )
    for what, state, key_type in (("names", osd, by_name_type), ("ids", by_id, by_id_type)):
        same = _rekey(fsdp, state, key_type, plain)
        assert list(same["state"]) == list(state["state"]), (
            f"{ctx.where()} rekey_optim_state_dict of a state keyed by {what} to "
            f"{key_type.name}: keys {list(same['state'])}, expected {list(state['state'])}"
        )
        for key, entry in state["state"].items():
            for field, value in entry.items():
                assert torch.equal(same["state"][key][field], value), (
                    f"{ctx.where()} rekey to {key_type.name}: state[{key!r}][{field!r}] changed"
                )
    for extra in (7, 0.5):
        bad = {**osd, "state": {**osd["state"], extra: {"step": torch.tensor(1.0)}}}
        pattern = "(?s)Invalid parameter keys" + "".join(rf"(?=.*'{n}')" for n in names)
        pattern += rf".*(?<![\w.]){re.escape(repr(extra))}(?![\w.])"
        for key_type in (by_id_type, by_name_type):
            expect_error(
                ctx,
                f"rekey_optim_state_dict(..., {key_type.name}) with the extra key {extra!r}",
                ValueError,
                pattern,
                lambda key_type=key_type, bad=bad: _rekey(fsdp, bad, key_type, plain),
            )


# ------------------------------------------------------------------------------ R92, R93
def _tied() -> nn.Sequential:
    """``Sequential(Linear(4, 4), Tanh(), Linear(4, 4))`` with ``2.weight`` the same parameter
    as ``0.weight``."""
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    seq[2].weight = seq[0].weight
    return seq


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_MODULE_TO},
    world_sizes=(1, 2),
)
def tied_params_double(ctx):
    """R92: one unit (``use_orig_params=True``) over ``Sequential(Linear(4, 4), Tanh(),
    Linear(4, 4))`` whose ``2.weight`` is ``0.weight``; ``model.double()`` before the first
    forward: every parameter of the wrapped module is float64, ``2.weight`` is still the same
    object as ``0.weight``; a forward (float64 output), backward (each rank's samples) and SGD
    step equal the unsharded model converted alike: its parameters after the step."""
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, use_orig_params=True)
    model.double()
    oracle.double()
    inner = model.module
    dtypes = {n: p.dtype for n, p in inner.named_parameters(remove_duplicate=False)}
    assert set(dtypes.values()) == {torch.float64}, (
        f"{ctx.where()} after .double(): parameter dtypes {dtypes}, expected float64 throughout"
    )
    assert inner[2].weight is inner[0].weight, (
        f"{ctx.where()} after .double(): 2.weight is no longer the same parameter as 0.weight"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x = _global_batch(ctx, 92, torch.float64)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    out = model(x[mine])
    assert out.dtype == torch.float64, f"{ctx.where()} forward output {out.dtype}"
    with torch.no_grad():
        assert_close(ctx, "forward after .double()", out, oracle(x)[mine], FP64)
    out.square().sum().div(B).backward()
    oracle(x).square().sum().div(ctx.world_size * B).backward()
    opt.step()
    oopt.step()
    assert_params_equal_oracle(ctx, model, oracle, "after .double() and a step", FP64)


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def tied_param_replaced_refused(ctx):
    """R93: one unit (``use_orig_params=True``) over ``Sequential(Linear(4, 4), Tanh(), Linear(4,
    4))`` whose ``2.weight`` is ``0.weight``; after construction ``2.weight`` is assigned a new
    ``nn.Parameter`` of zeros (breaking the tie): the next forward raises NotImplementedError
    "Changing shared parameters is not supported yet" on every rank."""
    ctx.seed(0)
    model = ctx.impl.shard(_tied().to(ctx.device), ctx, use_orig_params=True)
    inner = model.module

    def untie():
        inner[2].weight = nn.Parameter(torch.zeros(4, 4, device=ctx.device))

    expect_error(
        ctx,
        "forward after 2.weight, tied to 0.weight, was replaced",
        NotImplementedError,
        r"Changing shared parameters is not supported yet",
        untie,
        lambda: model(_global_batch(ctx, 93)),
    )


# ------------------------------------------------------------------------------ R94
SETATTR_CALLS: list[str] = []  # names assigned through _CountingLinear.__setattr__
INSIDE: list[dict] = []  # per _CountingLinear forward: name -> (registered, an nn.Parameter)


class _CountingLinear(nn.Linear):
    """A Linear whose ``__setattr__`` records assignments to ``weight`` and ``bias`` and whose
    forward records what each of the two names is."""

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):
            SETATTR_CALLS.append(name)
        super().__setattr__(name, value)

    def forward(self, x):
        registered = dict(self.named_parameters(recurse=False))
        INSIDE.append(
            {
                n: (n in registered, isinstance(getattr(self, n), nn.Parameter))
                for n in ("weight", "bias")
            }
        )
        return super().forward(x)


def _names_after(model) -> dict:
    """Per counting Linear and name: registered, an ``nn.Parameter``, the registered object."""
    out = {}
    linears = [m for m in model.modules() if isinstance(m, _CountingLinear)]
    for i, m in enumerate(linears):
        registered = dict(m.named_parameters(recurse=False))
        for n in ("weight", "bias"):
            value = getattr(m, n)
            out[f"{i}.{n}"] = (
                n in registered,
                isinstance(value, nn.Parameter),
                value is registered.get(n),
            )
    return out


def _shard_with_env(ctx, module, value, **kwargs):
    """``ctx.impl.shard`` with ``FSDP_USE_UNSAFE_SETATTR`` set to ``value`` (None: unset) during
    construction only; the environment is restored after it."""
    old = os.environ.pop(UNSAFE_SETATTR, None)
    if value is not None:
        os.environ[UNSAFE_SETATTR] = value
    try:
        return ctx.impl.shard(module, ctx, **kwargs)
    finally:
        os.environ.pop(UNSAFE_SETATTR, None)
        if old is not None:
            os.environ[UNSAFE_SETATTR] = old


UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_UNSAFE_SETATTR},
    cases={"flat": {"orig": False}, "orig-params": {"orig": True}},
    world_sizes=(1, 2),
)
def unsafe_setattr_knob(ctx, orig):
    """R94: one unit over ``Sequential(L(4, 4), Tanh(), L(4, 2))``, ``L`` a Linear whose
    ``__setattr__`` records assignments to ``weight`` and ``bias``, built without and with
    ``FSDP_USE_UNSAFE_SETATTR=1`` in the environment (during construction only), with
    ``use_orig_params`` False and True: over a forward (rank r's samples), backward and SGD step
    the override is called without the knob and never with it. Everything else is as without it:
    what each name is inside the forward (a registered parameter or not, an ``nn.Parameter`` or
    not) and after the step (also whether it is the registered parameter); the forward output
    and the parameters after the step equal the unsharded model's."""
    ctx.seed(0)
    initial = nn.Sequential(_CountingLinear(4, 4), nn.Tanh(), _CountingLinear(4, 2))
    initial = initial.to(ctx.device)
    oracle = copy.deepcopy(initial)
    x = _global_batch(ctx, 94)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    want_out = oracle(x)[mine].detach()
    oracle(x).square().sum().div(ctx.world_size * B).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()
    seen = {}
    for knob in (None, "1"):
        model = _shard_with_env(ctx, copy.deepcopy(initial), knob, use_orig_params=orig)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        SETATTR_CALLS.clear()
        INSIDE.clear()
        out = model(x[mine])
        assert_close(ctx, f"forward (knob {knob})", out, want_out, FP32["loss"])
        out.square().sum().div(B).backward()
        opt.step()
        seen[knob] = (list(SETATTR_CALLS), list(INSIDE), _names_after(model))
        assert_params_equal_oracle(ctx, model, oracle, f"after a step (knob {knob})")
    assert seen[None][0], (
        f"{ctx.where()} without {UNSAFE_SETATTR}: the modules' __setattr__ was never called"
    )
    assert not seen["1"][0], (
        f"{ctx.where()} with {UNSAFE_SETATTR}=1: the modules' __setattr__ was called for "
        f"{seen['1'][0]}"
    )
    for i, what in ((1, "inside the forward"), (2, "after the step")):
        assert seen["1"][i] == seen[None][i], (
            f"{ctx.where()} with {UNSAFE_SETATTR}=1, the names {what}: {seen['1'][i]}, "
            f"without it: {seen[None][i]}"
        )
