"""Area "state_dict": FSDP1's optimizer-state APIs on a model whose root is not FSDP (S46, S47).

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
