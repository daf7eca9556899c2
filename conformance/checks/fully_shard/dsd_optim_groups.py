"""Area "fsdp2_state_dict": ``torch.distributed.checkpoint.state_dict`` (DSD) optimizer state
beyond P29's one-group Adam, on a ``fully_shard`` model (P45-P50).

[Note: what DSD's optimizer helpers keep]
* Param groups: every group keeps its own hyperparameters. ``get_optimizer_state_dict`` of an
  optimizer that has not stepped yet first initializes its state with a step at ``lr`` 0 and
  then gives each group its own ``lr`` back, so the dict and the optimizer still hold each
  group's ``lr``; with ``flatten_optimizer_state_dict=True`` each parameter's
  ``param_groups.<fqn>.<option>`` is its own group's value. A dict with two groups loads back
  through ``set_optimizer_state_dict`` with default options (sharded, strict) and one more step
  gives the unsharded model's parameters.
* ``submodules=`` (deprecated) narrows the model state dict only: ``get_state_dict(model, optim,
  submodules={model.lin2})`` gives ``lin2``'s model entries and the state of every parameter,
  as ``get_optimizer_state_dict`` gives it with or without ``submodules``.
* A parameter with two FQNs has its state and its place in the param groups once, and it loads.
* Flattening (``flatten_optimizer_state_dict=True``) turns a dict-valued state entry into one key
  per leaf (``state.<fqn>.<name>.<key>``) and rebuilds it on load; a value that is not a tensor,
  int, float or dict (a list) is refused with NotImplementedError ("Flattening optimizer
  state_dict only supports tensor, int, float, dict states").
* ``dsd_fqn_modifiers`` names the method through which a module says that a state-dict key
  ``<name>`` lives in its child (``{name: child}``): with it, a module whose own state-dict hooks
  hide that child's name gets the hook's keys in DSD's dict, with this rank's chunks as values.
  (torch 2.13's ``get_model_state_dict`` maps keys with the default name ``_fqn_modifiers``
  whatever the option says, so a method of another name fails there with AttributeError: the
  ``custom-name`` case is pinned as an expected failure of torch 2.13's DSD.)

The oracle is the unsharded model with its own optimizer, fed the same global batch.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks._shared.sd_models import SharedWeightNet
from conformance.checks.fully_shard.dsd_optim_state import _assert_state
from conformance.checks.fully_shard.state_dict import PLAN, Net
from conformance.registry import check

REQUIRES = {base.DCP_HELPERS, base.DTENSOR_PARAMS, base.FSDP2_API, base.TRAINING}
AREA = "fsdp2_state_dict"
STEPS = 2
GROUPS = ({"lr": 1e-2, "weight_decay": 0.0}, {"lr": 5e-3, "weight_decay": 0.1})


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _step(ctx, model, opt, step, features=4):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(ctx.world_size * 2, features, generator=g).to(ctx.device)  # global batch
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _two_groups(model):
    """lin1's parameters at GROUPS[0], lin2's at GROUPS[1]."""
    return [
        dict(params=list(model.lin1.parameters()), **GROUPS[0]),
        dict(params=list(model.lin2.parameters()), **GROUPS[1]),
    ]


def _full(param):
    return param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()


def _assert_params(ctx, model, oracle, what):
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} {what}", _full(model.get_parameter(name)), ref, FP32["param"])


def _trained_groups(ctx):
    oracle = Net(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt = torch.optim.Adam(_two_groups(oracle))
    opt = torch.optim.Adam(_two_groups(model))
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    return oracle, oopt, model, opt


def _assert_groups(ctx, osd, flatten, what):
    """Each group of ``osd`` lists its module's FQNs with that group's ``lr`` / ``weight_decay``
    (flattened: per parameter ``param_groups.<fqn>.<option>``)."""
    for module, options in zip(("lin1", "lin2"), GROUPS):
        fqns = [f"{module}.weight", f"{module}.bias"]
        for key, value in options.items():
            if flatten:
                for fqn in fqns:
                    got = osd.get(f"param_groups.{fqn}.{key}")
                    assert got == value, (
                        f"{ctx.where()} {what}: param_groups.{fqn}.{key} = {got!r}, expected "
                        f"{module}'s group's {value!r}"
                    )
                continue
            group = [g for g in osd["param_groups"] if fqns[0] in g["params"]]
            assert len(group) == 1 and sorted(group[0]["params"]) == sorted(fqns), (
                f"{ctx.where()} {what}: groups {[g['params'] for g in osd['param_groups']]}, "
                f"expected one listing {fqns}"
            )
            assert group[0][key] == value, (
                f"{ctx.where()} {what}: {module}'s group has {key} = {group[0][key]!r}, "
                f"expected {value!r}"
            )


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def dsd_optim_groups_before_step(ctx):
    """P45: ``get_optimizer_state_dict`` of a fresh two-group Adam (never stepped) leaves each
    group its own ``lr`` (in the optimizer and in the dict, nested and flattened) and the model's
    parameters unchanged."""
    dsd = _dsd()
    for flatten in (False, True):
        oracle = Net(0).to(ctx.device)
        model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
        opt = torch.optim.Adam(_two_groups(model))
        opts = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)
        osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
        _assert_groups(ctx, osd, flatten, f"fresh optimizer (flatten={flatten})")
        for i, (group, options) in enumerate(zip(opt.param_groups, GROUPS)):
            assert group["lr"] == options["lr"], (
                f"{ctx.where()} optimizer group {i} lr {group['lr']!r} after "
                f"get_optimizer_state_dict, expected its own {options['lr']!r}"
            )
        _assert_params(ctx, model, oracle, "after get_optimizer_state_dict of a fresh optimizer")


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"nested": {"flatten": False}, "flatten": {"flatten": True}},
    world_sizes=(2,),
)
def dsd_optim_groups_round_trip(ctx, flatten):
    """P45: after two steps of a two-group Adam, ``get_optimizer_state_dict`` keeps each group's
    FQNs and hyperparameters (flattened: per parameter) and the unsharded optimizer's state;
    ``set_optimizer_state_dict`` with default options (plus the same ``flatten``) into a fresh
    model and optimizer restores it, and one more step gives the unsharded model's parameters."""
    dsd = _dsd()
    oracle, oopt, model, opt = _trained_groups(ctx)
    opts = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
    _assert_groups(ctx, osd, flatten, "get_optimizer_state_dict")
    msd = dsd.get_model_state_dict(model)
    fresh = ctx.impl.shard(Net(3).to(ctx.device), ctx, plan=PLAN)
    fopt = torch.optim.Adam(_two_groups(fresh))
    dsd.set_model_state_dict(fresh, msd)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=opts)
    back = dsd.get_optimizer_state_dict(fresh, fopt)
    _assert_groups(ctx, back, False, "after the load")
    _assert_state(ctx, back, oracle, oopt, False, "after the load")
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, f"one step after the load (vs the oracle after {STEPS + 1})")


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def dsd_optim_submodules(ctx):
    """P46: ``get_state_dict(model, optim, submodules={model.lin2})`` gives only ``lin2``'s
    model entries and the optimizer state of every parameter, equal to the unsharded optimizer's
    (this rank's chunks), as ``get_optimizer_state_dict`` gives it with ``submodules`` too."""
    dsd = _dsd()
    oracle, oopt, model, opt = _trained_groups(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        msd, osd = dsd.get_state_dict(model, opt, submodules={model.lin2})
        only = dsd.get_optimizer_state_dict(model, opt, submodules={model.lin2})
    assert sorted(msd) == ["lin2.bias", "lin2.weight"], (
        f"{ctx.where()} get_state_dict(submodules={{lin2}}): model keys {sorted(msd)}, expected "
        "lin2's"
    )
    for key in msd:
        want = chunk_of(oracle.get_parameter(key).detach().cpu(), 0, ctx.world_size, ctx.rank)
        assert_close(ctx, f"model entry {key}", msd[key].to_local(), want, FP32["param"])
    _assert_state(ctx, osd, oracle, oopt, False, "get_state_dict(submodules=) optimizer")
    _assert_state(ctx, only, oracle, oopt, False, "get_optimizer_state_dict(submodules=)")


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def dsd_optim_shared_param(ctx):
    """P47: on a model whose two modules share a weight (``b.weight is a.weight``), sharded as
    one unit, the sharded optimizer state
    dict loads through ``set_optimizer_state_dict`` into a fresh model and optimizer, and one more
    Adam step gives the unsharded model's parameters."""
    _shared_weight_round_trip(ctx, None, "")


def _shared_weight_round_trip(ctx, options, what):
    """P47's round trip, with DSD ``options`` (None: the defaults): an Adam on a shared-weight
    model, sharded as one unit, is stepped; its model and optimizer dicts load into a fresh
    model and optimizer, whose ``step`` equals the unsharded optimizer's and whose next step
    gives the unsharded model's parameters. ``what`` names the case in failure messages."""
    dsd = _dsd()
    kw = {} if options is None else {"options": options}
    oracle = SharedWeightNet(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("", {})])
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = dsd.get_optimizer_state_dict(model, opt, **kw)
    msd = dsd.get_model_state_dict(model)
    fresh = ctx.impl.shard(SharedWeightNet(3).to(ctx.device), ctx, plan=[("", {})])
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_model_state_dict(fresh, msd)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, **kw)
    for p, fp in zip(oracle.parameters(), fresh.parameters()):
        assert float(fopt.state[fp]["step"]) == float(oopt.state[p]["step"]), (
            f"{ctx.where()} {what}after the load: step {fopt.state[fp]['step']}, expected "
            f"{oopt.state[p]['step']}"
        )
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, f"{what}one step after the load")


class _InfoSGD(torch.optim.SGD):
    """SGD that keeps, per parameter, a dict state entry ``info = {"calls": n, "scale": f}`` (and
    with ``with_list`` a list entry ``hist``)."""

    def __init__(self, params, with_list=False):
        super().__init__(params, lr=0.1)
        self.with_list = with_list

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                calls = self.state[p].get("info", {}).get("calls", 0) + 1
                self.state[p]["info"] = {"calls": calls, "scale": 0.5 * calls}
                if self.with_list:
                    self.state[p]["hist"] = [calls]
        return out


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def dsd_optim_flatten_nested_values(ctx):
    """P48: with ``flatten_optimizer_state_dict=True`` a dict-valued state entry ``info`` becomes
    ``state.<fqn>.info.calls`` / ``state.<fqn>.info.scale`` and loads back into a fresh optimizer
    as the dict the unsharded optimizer has; a list-valued entry is refused with
    NotImplementedError naming the supported types."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt, opt = _InfoSGD(oracle.parameters()), _InfoSGD(model.parameters())
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    opts = dsd.StateDictOptions(flatten_optimizer_state_dict=True)
    osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
    for name, p in oracle.named_parameters():
        for key, value in oopt.state[p]["info"].items():
            got = osd.get(f"state.{name}.info.{key}")
            assert got == value, (
                f"{ctx.where()} flattened: state.{name}.info.{key} = {got!r}, expected {value!r}"
            )
    fresh = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    fopt = _InfoSGD(fresh.parameters())
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=opts)
    for (name, p), fp in zip(oracle.named_parameters(), fresh.parameters()):
        got = fopt.state[fp].get("info")
        assert got == oopt.state[p]["info"], (
            f"{ctx.where()} after the flattened load: {name} info {got!r}, expected "
            f"{oopt.state[p]['info']!r}"
        )
    lopt = _InfoSGD(model.parameters(), with_list=True)
    _step(ctx, model, lopt, 0)
    try:
        dsd.get_optimizer_state_dict(model, lopt, options=opts)
    except NotImplementedError as exc:
        assert "only supports" in str(exc), (
            f"{ctx.where()} NotImplementedError {str(exc)[:160]!r}, expected it to name the "
            "supported types"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} flatten_optimizer_state_dict=True accepted a list state entry; "
            "expected NotImplementedError"
        )


class _Hidden(nn.Module):
    """Holds a Linear(10, 3) as ``base`` but saves and loads its entries as ``weight`` / ``bias``
    (state-dict hooks drop ``base.``); a method of the name the subclass gives tells DSD so
    (``{name: "base"}``)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(10, 3)
        self._register_state_dict_hook(_Hidden._drop)
        self._register_load_state_dict_pre_hook(_Hidden._add)

    @staticmethod
    def _drop(module, sd, prefix, local_metadata):
        for key in [k for k in sd if k.startswith(prefix + "base.")]:
            sd[prefix + key[len(prefix + "base.") :]] = sd.pop(key)
        return sd

    @staticmethod
    def _add(sd, prefix, *args):
        for name in ("weight", "bias"):
            if prefix + name in sd:
                sd[prefix + "base." + name] = sd.pop(prefix + name)

    @staticmethod
    def _modifiers():
        return {"weight": "base", "bias": "base"}

    def forward(self, x):
        return self.base(x)


class _HiddenDefault(_Hidden):
    def _fqn_modifiers(self):  # DSD's default method name
        return self._modifiers()


class _HiddenRenames(_Hidden):
    def _renames(self):
        return self._modifiers()


HIDDEN = {"_fqn_modifiers": _HiddenDefault, "_renames": _HiddenRenames}


class _HiddenNet(nn.Module):
    def __init__(self, salt=0, method="_fqn_modifiers"):
        super().__init__()
        source = Net(salt)
        self.lin1 = source.lin1
        self.lin2 = HIDDEN[method]()
        self.lin2.base.load_state_dict(source.lin2.state_dict())

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


@check(
    area=AREA,
    requires=REQUIRES - {base.TRAINING},
    cases={"default-name": {"method": "_fqn_modifiers"}, "custom-name": {"method": "_renames"}},
    world_sizes=(2,),
)
def dsd_fqn_modifiers(ctx, method):
    """P49: ``StateDictOptions(dsd_fqn_modifiers=method)`` on a model whose ``lin2`` saves its
    child ``base``'s entries as ``lin2.weight`` / ``lin2.bias`` and says so through its method of
    that name (DSD's default ``_fqn_modifiers``, or ``_renames``): ``get_model_state_dict`` has exactly those keys with this rank's chunks of
    the values, and ``set_model_state_dict`` of another such model's dict loads them."""
    dsd = _dsd()
    opts = dsd.StateDictOptions(dsd_fqn_modifiers=method)
    model = _HiddenNet(1, method).to(ctx.device)
    model = ctx.impl.shard(model, ctx, plan=[("lin1", {}), ("", {})])
    plain = {k: v.detach().cpu().clone() for k, v in _HiddenNet(1, method).state_dict().items()}
    sd = dsd.get_model_state_dict(model, options=opts)
    assert (
        sorted(sd) == sorted(plain) == ["lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"]
    ), f"{ctx.where()} keys {sorted(sd)}, expected the hooks' {sorted(plain)}"
    for key, value in sd.items():
        want = chunk_of(plain[key], 0, ctx.world_size, ctx.rank)
        assert torch.equal(value.to_local().detach().cpu(), want), (
            f"{ctx.where()} {key}: not this rank's chunk of the model's value"
        )
    target = _HiddenNet(4, method).to(ctx.device)
    target = ctx.impl.shard(target, ctx, plan=[("lin1", {}), ("", {})])
    dsd.set_model_state_dict(target, sd, options=opts)
    for key, value in dsd.get_model_state_dict(target, options=opts).items():
        want = chunk_of(plain[key], 0, ctx.world_size, ctx.rank)
        assert torch.equal(value.to_local().detach().cpu(), want), (
            f"{ctx.where()} after set_model_state_dict: {key} not this rank's chunk of the "
            "loaded value"
        )
