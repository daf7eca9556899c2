"""Area "fsdp1_runtime": FSDP1's refusals on paths no other case ran: constructor arguments,
``register_comm_hook``, units of mixed ``use_orig_params``, a double backward, mixed state-dict
types, optimizer-state API arguments and ``ShardedGradScaler.update`` (R95-R101); optimizer
state of parameters that have none, or none but Python values (R102, R103).

[Note: refusals are contracts]
Each refusal is pinned by its exception type and a stable part of its message (upstream's
wording), and where it is cheap the check also shows that the refused call changed nothing: the
module keeps its parameters, a later valid call still succeeds, the settings stay as they were.
"""

from __future__ import annotations

import importlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import full_params
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

    def hook(state, grad, output=None):
        calls.append(state)
        if output is None:
            dist.all_reduce(grad)
        else:
            dist.reduce_scatter_tensor(output, grad)

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
