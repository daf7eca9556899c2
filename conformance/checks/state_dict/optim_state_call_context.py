"""Area "state_dict": where ``FullyShardedDataParallel.optim_state_dict`` may be called from: inside
``summon_full_params`` over a model with a child literally named ``module`` (S58), and after an
earlier call that raised, its exception still alive (S59).

The oracle is an unsharded copy of the model stepped by its own Adam on the same batch (every rank
feeds the same batch, so the averaged sharded gradient is the unsharded one): the FULL dict holds
its state under its FQNs (S24, compared by ``_shared/optim_state.assert_state``). The FULL dicts
are taken with ``offload_to_cpu=False`` (S30: torch 2.13's CPU offload of a ``use_orig_params``
unit's state is wrong on a CPU compute device).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.checks._shared.optim_state import assert_state
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_OPTIM_STATE_DICT, base.TRAINING}


def _full_optim(ctx, model):
    """``state_dict_type(model, FULL_STATE_DICT, ..., FullOptimStateDictConfig(offload_to_cpu=
    False))``."""
    ns = ctx.impl.ns
    return ns.FullyShardedDataParallel.state_dict_type(
        model,
        ns.StateDictType.FULL_STATE_DICT,
        ns.FullStateDictConfig(),
        ns.FullOptimStateDictConfig(offload_to_cpu=False),
    )


def _step_both(ctx, model, oracle, salt):
    """One Adam step (lr 0.1) of ``model`` and of the unsharded ``oracle`` on the same batch of
    four features; returns ``(opt, oracle_opt)``."""
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    oopt = torch.optim.Adam(oracle.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(salt)
    x = torch.randn(2, 4, generator=g).to(ctx.device)
    for m, o in ((model, opt), (oracle, oopt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    return opt, oopt


# ------------------------------------------------------------------------------ S58
class _Wrapper(nn.Module):
    """``head(module(x))``: a child literally named ``module`` (``Sequential(Linear(4, 4),
    Linear(4, 4))``) beside ``head`` (``Linear(4, 4)``)."""

    def __init__(self):
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.module(x))


@check(
    area="state_dict",
    requires=REQUIRES,
    cases={"one_unit": {"nested": False}, "nested_module_unit": {"nested": True}},
    world_sizes=(1, 2),
)
def fsdp1_optim_state_dict_in_summon(ctx, nested):
    """S58: ``optim_state_dict(model, optim)`` called inside ``summon_full_params(model)`` gives
    what it gives outside: FULL keys ``head.*``, ``module.0.*``, ``module.1.*`` (the unwrapped
    model's FQNs, the child named ``module`` keeping its name) with the unsharded Adam's state,
    over one unit (``use_orig_params=True``) of ``head(module(x))``, and with ``module`` its own
    unit inside the root."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = _Wrapper().to(ctx.device)
    plain = copy.deepcopy(oracle)
    if nested:
        plain.module = fsdp(plain.module, use_orig_params=True, **_kwargs(ctx))
    model = fsdp(plain, use_orig_params=True, **_kwargs(ctx))
    opt, oopt = _step_both(ctx, model, oracle, 58)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _full_optim(ctx, model):
            outside = fsdp.optim_state_dict(model, opt)
            with fsdp.summon_full_params(model):
                inside = fsdp.optim_state_dict(model, opt)
    assert_state(ctx, outside, oracle, oopt, True, "optim_state_dict outside summon", None)
    assert_state(ctx, inside, oracle, oopt, True, "optim_state_dict inside summon", None)


# ------------------------------------------------------------------------------ S59
@check(area="state_dict", requires=REQUIRES, world_sizes=(1, 2))
def fsdp1_optim_state_dict_after_failed_call(ctx):
    """S59: a failed ``optim_state_dict`` call leaves nothing behind for the next one: over one
    unit (``use_orig_params=True``) of ``Sequential(Linear(4, 4), Linear(4, 4))`` after an Adam
    step, ``optim_state_dict(model, other)`` with an optimizer over a parameter the model does not
    have raises (upstream: KeyError); with that exception kept alive (its traceback holds the
    failed call's frames), ``optim_state_dict(model, optim)`` returns the unsharded Adam's state
    under ``0.weight``, ``0.bias``, ``1.weight``, ``1.bias``."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    model = fsdp(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    opt, oopt = _step_both(ctx, model, oracle, 59)
    foreign = nn.Parameter(torch.ones(3, device=ctx.device))
    other = torch.optim.Adam([foreign], lr=0.1)
    foreign.grad = torch.ones_like(foreign)
    other.step()
    kept = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _full_optim(ctx, model):
            try:
                fsdp.optim_state_dict(model, other)
            except Exception as exc:  # noqa: BLE001 - any refusal; kept alive below
                kept = exc
            assert kept is not None, (
                f"{ctx.where()} optim_state_dict with an optimizer over a parameter the model "
                "does not have was accepted"
            )
            osd = fsdp.optim_state_dict(model, opt)
    assert_state(ctx, osd, oracle, oopt, True, "optim_state_dict after a failed call", None)
    assert kept.__traceback__ is not None  # still alive up to here
