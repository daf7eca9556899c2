"""Area "state_dict": whose names key FSDP1's optimizer state dict (S53, S54).

[Note: the names an optimizer state dict is keyed by]
``optim_state_dict`` keys each parameter's state by the FQN the *root the user passes* gives it
through ``named_parameters()``, with FSDP's own wrapper prefixes (``_fsdp_wrapped_module.``,
``_flat_param`` expanded to the original parameters) and activation checkpointing's
(``_checkpoint_wrapped_module.``) removed. Two consequences the checks here pin down:
* a root that overrides ``named_parameters`` to hide a level of its own (a data-parallel style
  wrapper that reports its held model's names, ``0.weight`` rather than ``module.0.weight``) gets
  the names it reports, exactly as its unwrapped twin reports them (S53);
* removing those prefixes can make two different parameters' names equal (a unit ``x`` beside a
  child registered as ``_checkpoint_wrapped_module`` that holds another unit ``x``). One key cannot
  hold two states, so ``optim_state_dict`` must not return a dict that silently keeps only one of
  them: it refuses the model, or keys every parameter apart (S54).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, full_params
from conformance.checks.state_dict.optim_groups import REQUIRES, _assert_osd, _context, _osd, _quiet
from conformance.registry import check


class NameHider(nn.Module):
    """Holds ``module`` and reports the held model's parameter names as its own (no ``module.``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _step(ctx, model, opt, salt):
    g = torch.Generator().manual_seed(900 + salt)
    x = torch.randn(ctx.world_size * 2, 4, generator=g).to(ctx.device)  # the global batch
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    opt.step()


def _hider(ctx, orig_params, salt):
    ctx.seed(salt)
    oracle = NameHider(_net().to(ctx.device))
    model = NameHider(
        ctx.impl.shard(copy.deepcopy(oracle.module), ctx, use_orig_params=orig_params)
    )
    return oracle, model


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"orig_params": {"orig_params": True}, "flat_params": {"orig_params": False}},
    world_sizes=(1, 2),
)
def fsdp1_optim_root_hides_module_level(ctx, orig_params):
    """S53: a plain root over an FSDP model whose ``named_parameters`` reports the held model's
    names (``0.weight``, not ``module.0.weight``): after an Adam step on the global batch,
    ``optim_state_dict`` under FULL is keyed by the names the unwrapped twin reports, with the
    unsharded Adam's state; it loads through ``optim_state_dict_to_load`` into a fresh such root,
    and one more step gives the unsharded model's parameters."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    oracle, model = _hider(ctx, orig_params, 0)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(ctx, oracle, oopt, 0)
    _step(ctx, model, opt, 0)
    osd = _osd(ctx, model, opt, "full", offload=False)
    want = sorted(n for n, _ in oracle.named_parameters())
    assert sorted(osd["state"]) == want, (
        f"{ctx.where()} optim_state_dict keys {sorted(osd['state'])}, expected the names the "
        f"root reports through named_parameters() {want}"
    )
    _assert_osd(ctx, osd, oracle, oopt, True, "optim_state_dict of a root hiding its level")
    msd = ctx.impl.state_dict(model.module, "full")
    _, fresh = _hider(ctx, orig_params, 1)
    ctx.impl.load_state_dict(fresh.module, msd, "full")
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with _context(ctx, fresh, "full"):
        fopt.load_state_dict(_quiet(fsdp.optim_state_dict_to_load, fresh, fopt, osd))
    _step(ctx, oracle, oopt, 1)
    _step(ctx, fresh, fopt, 1)
    got = full_params(ctx, fresh.module)
    for name, ref in oracle.module.named_parameters():
        assert_close(ctx, f"{name} one step after the load", got[name], ref, FP32["param"])


class Inner(nn.Module):
    def __init__(self, unit: nn.Module):
        super().__init__()
        self.x = unit

    def forward(self, h):
        return self.x(h)


class Colliding(nn.Module):
    """A unit ``x`` and a child registered as ``_checkpoint_wrapped_module`` holding another unit
    ``x``: with checkpointing's prefix removed both units' parameters are ``x.weight``, ``x.bias``."""

    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__()
        self.x = first
        self.add_module("_checkpoint_wrapped_module", Inner(second))

    def forward(self, h):
        return self._checkpoint_wrapped_module(torch.tanh(self.x(h)))


@check(area=AREA, requires=REQUIRES, world_sizes=(1, 2))
def fsdp1_optim_colliding_fqns(ctx):
    """S54: two FSDP units whose parameters' names coincide once checkpointing's
    ``_checkpoint_wrapped_module.`` is removed (``x.weight`` twice): after an Adam step every one
    of the 4 parameters has state, and ``optim_state_dict`` either refuses the model (raises) or
    returns state for all 4 parameters under 4 keys; a dict holding fewer has silently lost a
    unit's state."""
    ctx.seed(0)
    model = Colliding(
        ctx.impl.shard(nn.Linear(4, 4).to(ctx.device), ctx),
        ctx.impl.shard(nn.Linear(4, 4).to(ctx.device), ctx),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(ctx, model, opt, 0)
    stated = sum(1 for p in opt.state.values() if p)  # flat parameters (or originals) with state
    assert stated >= 2, f"{ctx.where()} precondition: the optimizer holds state for {stated}"
    try:
        osd = _osd(ctx, model, opt, "full", offload=False)
    except Exception:  # noqa: BLE001 - refusing the ambiguous model is what the rule allows
        return
    keys = sorted(osd["state"])
    assert len(keys) == 4, (
        f"{ctx.where()} optim_state_dict returned state under {keys} for a model of 4 parameters "
        "with state: two units' parameters share a cleaned name and one unit's state was dropped "
        "(it must refuse the model or key each parameter apart)"
    )
