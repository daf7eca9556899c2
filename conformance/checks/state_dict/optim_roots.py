"""Area "state_dict": FSDP1's optimizer-state APIs on a model whose root is not FSDP (S46, S47,
S65).

[Note: a plain root over FSDP units]
The optimizer-state APIs take the *model* the user holds, which need not be an FSDP unit: a plain
module whose children are (or hold) FSDP units is as valid a root for them as for
``state_dict()``. Two things follow:
* keys: the state is keyed by the model's own FQNs, those of ``model.state_dict()`` and
  ``model.named_parameters()``. A child attribute literally named ``module`` (the name DDP and many
  user wrappers give the wrapped model) is part of those FQNs: ``module.inner.weight``, never
  ``inner.weight``, although FSDP's own wrapper prefixes are stripped.
* one setting: the units must agree on ``use_orig_params`` (the optimizer state maps to flat
  parameters or to the original ones, for the whole model). Lazy initialisation checks that only
  within one FSDP root's tree, so two separately wrapped children that disagree are caught by the
  optimizer-state APIs themselves: ``optim_state_dict`` and ``optim_state_dict_to_load`` refuse
  the model with AssertionError ("Not all FSDP modules have the same _use_orig_params value").
The oracle is the same plain root over the unwrapped modules, with its own optimizer, fed the same
global batch on every rank.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.checks.state_dict.optim_groups import (
    PLAN,
    REQUIRES,
    STEPS,
    CountingAdam,
    _assert_osd,
    _context,
    _groups,
    _osd,
    _step,
)
from conformance.registry import check


class Holder(nn.Module):
    """A plain wrapper whose one child is named ``module`` (as DDP names the model it wraps)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _holder(ctx, salt):
    """(oracle, model): ``Holder(InnerHeadNet)`` unwrapped, and the same values with the held
    model sharded (``inner`` its own unit, then the held model's root unit)."""
    ctx.seed(salt)
    oracle = Holder(InnerHeadNet().to(ctx.device))
    model = Holder(ctx.impl.shard(copy.deepcopy(oracle.module), ctx, plan=PLAN))
    return oracle, model


@check(area=AREA, requires=REQUIRES, world_sizes=(1,))
def fsdp1_optim_child_named_module(ctx):
    """S46: on a plain root whose child ``module`` is an FSDP model, after 2 Adam steps (two param
    groups) ``optim_state_dict`` under FULL is keyed by the root's own FQNs (``module.inner.weight``,
    as ``model.state_dict()``) with the unsharded optimizer's state and groups; it loads through
    ``optim_state_dict_to_load`` into a freshly built root of the same shape, and one more step
    gives the unsharded model's parameters."""
    oracle, model = _holder(ctx, 0)
    oopt = CountingAdam(_groups(oracle.named_parameters()))
    opt = CountingAdam(_groups(model.named_parameters()))
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = _osd(ctx, model, opt, "full", offload=False)
    want = sorted(n for n, _ in oracle.named_parameters())
    assert sorted(osd["state"]) == want, (
        f"{ctx.where()} optim_state_dict keys {sorted(osd['state'])}, expected the root's FQNs "
        f"{want} (the child named 'module' is part of them)"
    )
    _assert_osd(ctx, osd, oracle, oopt, True, "optim_state_dict of a plain root")
    msd = ctx.impl.state_dict(model, "full")
    _, fresh = _holder(ctx, 1)
    ctx.impl.load_state_dict(fresh, msd, "full")
    fopt = CountingAdam(_groups(fresh.named_parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, fresh, "full"):
            flat = ctx.impl.ns.FullyShardedDataParallel.optim_state_dict_to_load(fresh, fopt, osd)
    fopt.load_state_dict(flat)
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    got = full_params(ctx, fresh)
    assert sorted(got) == want, f"{ctx.where()} parameters {sorted(got)}, expected {want}"
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} one step after the load", got[name], ref, FP32["param"])


class TwoUnits(nn.Module):
    """Two separately wrapped children ``a`` Linear(4, 4) -> tanh -> ``b`` Linear(4, 4)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _two_units(ctx, orig_a, orig_b):
    ctx.seed(0)
    model = TwoUnits().to(ctx.device)
    model.a = ctx.impl.shard(model.a, ctx, use_orig_params=orig_a)
    model.b = ctx.impl.shard(model.b, ctx, use_orig_params=orig_b)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    (model(x) ** 2).mean().backward()
    opt.step()
    return model, opt


MIXED = r"_use_orig_params"


@check(area=AREA, requires=REQUIRES, world_sizes=(1,))
def fsdp1_optim_mixed_orig_params_refused(ctx):
    """S47: a plain root over two separately wrapped units, ``a`` with ``use_orig_params=True`` and
    ``b`` with False, trains, but ``optim_state_dict`` refuses it with AssertionError naming
    ``_use_orig_params``, and so does ``optim_state_dict_to_load`` of the FULL dict of the same
    model built with both units False (which itself saves)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    same, same_opt = _two_units(ctx, False, False)
    osd = _osd(ctx, same, same_opt, "full", offload=False)
    assert sorted(osd["state"]) == ["a.bias", "a.weight", "b.bias", "b.weight"], (
        f"{ctx.where()} precondition: the homogeneous model's keys {sorted(osd['state'])}"
    )
    mixed, opt = _two_units(ctx, True, False)
    calls = {
        "optim_state_dict": lambda: fsdp.optim_state_dict(mixed, opt),
        "optim_state_dict_to_load": lambda: fsdp.optim_state_dict_to_load(mixed, opt, osd),
    }
    for name, call in calls.items():

        def quietly(call=call):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with _context(ctx, mixed, "full"):
                    call()

        what = f"{name} on units mixing use_orig_params True and False"
        expect_error(ctx, what, AssertionError, MIXED, quietly)


NOTE = torch.tensor([3.0, -1.5])


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"flat-params": {"orig_params": False}, "orig-params": {"orig_params": True}},
    world_sizes=(2,),
)
def fsdp1_optim_named_plain_root_user_state(ctx, orig_params):
    """S65: on a plain root ``InnerHeadNet`` whose ``inner`` alone is an FSDP unit (``head`` a
    plain Linear), after 2 steps of an Adam with two groups and a state entry ``note`` tied to no
    parameter (added last), ``optim_state_dict`` under FULL given that optimizer's dict keyed by
    the model's parameter names (``optim_state_dict=``, as a named optimizer saves; ``head``'s
    names are already FQNs and come before ``note``) gives the unsharded optimizer's state under
    the FQNs and ``note`` unchanged: every entry after a plain parameter's is still read."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = copy.deepcopy(oracle)
    model.inner = ctx.impl.shard(model.inner, ctx, use_orig_params=orig_params)
    oopt = CountingAdam(_groups(oracle.named_parameters()))
    opt = CountingAdam(_groups(model.named_parameters()))
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    opt.state["note"] = NOTE.clone()
    name_of = {p: n for n, p in model.named_parameters()}
    order = [name_of[p] for g in opt.param_groups for p in g["params"]]
    own = opt.state_dict()
    state = {(order[k] if isinstance(k, int) else k): v for k, v in own["state"].items()}
    assert list(state)[-1] == "note" and "head.weight" in state, (
        f"{ctx.where()} precondition: named state keys {list(state)}"
    )
    groups = [dict(g, params=[order[i] for i in g["params"]]) for g in own["param_groups"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning naming 'note' (S41's check asserts it)
        with _context(ctx, model, "full", offload=False):
            osd = fsdp.optim_state_dict(
                model, opt, optim_state_dict={"state": state, "param_groups": groups}
            )
    note = osd["state"].pop("note", None)
    assert torch.is_tensor(note) and torch.equal(note, NOTE), (
        f"{ctx.where()} state entry 'note' {note!r}, expected {NOTE} unchanged (keys "
        f"{sorted(osd['state'])})"
    )
    _assert_osd(ctx, osd, oracle, oopt, True, "optim_state_dict of a named dict, plain root")
