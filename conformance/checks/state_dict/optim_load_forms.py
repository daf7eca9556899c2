"""Area "state_dict": the forms FSDP1's optimizer state dicts take on paths no other case ran: a
dict to load without ``param_groups`` (S55), a parameter whose local shard is one element (S56)
and ``optim_state_dict_to_load`` called through an instance (S57).

The oracle is an unsharded copy of the model stepped by the same optimizer on the global batch,
or the class call's result for the instance call.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _batch, _kwargs
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_OPTIM_STATE_DICT}
NAMES = ("0.weight", "0.bias", "1.weight", "1.bias")


def _trained(ctx, use_orig_params):
    """One unit over ``Sequential(Linear(4, 4), Linear(4, 4))`` after one Adam step."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    model = fsdp(plain, use_orig_params=use_orig_params, **_kwargs(ctx))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(_batch(ctx, 55)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return fsdp, model, opt


def _same_state(ctx, what, got, want):
    assert sorted(got) == sorted(want), (
        f"{ctx.where()} {what}: state keys {sorted(got)}, expected {sorted(want)}"
    )
    for key in want:
        assert sorted(got[key]) == sorted(want[key]), (
            f"{ctx.where()} {what}[{key!r}]: entries {sorted(got[key])}, expected "
            f"{sorted(want[key])}"
        )
        for name, value in want[key].items():
            if isinstance(value, torch.Tensor):
                assert_close(
                    ctx, f"{what}[{key!r}][{name!r}]", got[key][name], value, FP32["param"]
                )
            else:
                assert got[key][name] == value, (
                    f"{ctx.where()} {what}[{key!r}][{name!r}] = {got[key][name]!r}, expected "
                    f"{value!r}"
                )


# ------------------------------------------------------------------------------ S55
@check(area="state_dict", requires=REQUIRES, world_sizes=(1, 2))
def fsdp1_optim_load_without_param_groups(ctx):
    """S55: ``optim_state_dict_to_load(model, optim, {"state": osd["state"]})`` (no
    ``param_groups``) returns a dict whose only key is ``state``, holding the same per-parameter
    state as the call with the whole ``osd`` (one entry per flat parameter, or per original
    parameter with ``use_orig_params=True``; one Adam step over one unit of two ``Linear(4, 4)``)."""
    for use_orig_params in (False, True):
        fsdp, model, opt = _trained(ctx, use_orig_params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            osd = fsdp.optim_state_dict(model, opt)
            whole = fsdp.optim_state_dict_to_load(model, opt, copy.deepcopy(osd))
            got = fsdp.optim_state_dict_to_load(model, opt, {"state": osd["state"]})
        what = f"use_orig_params={use_orig_params} to_load without param_groups"
        assert isinstance(got, dict) and list(got) == ["state"], (
            f"{ctx.where()} {what} gave {got!r}: expected a dict with the only key 'state'"
        )
        _same_state(ctx, what, got["state"], whole["state"])


# ------------------------------------------------------------------------------ S56
@check(area="state_dict", requires=REQUIRES | {base.TRAINING}, world_sizes=(2,))
def fsdp1_optim_one_element_shards(ctx):
    """S56: one unit (``use_orig_params=True``) over ``Linear(1, 1)`` at ws 2, so each rank's
    shard is one whole 1-element parameter: after one Adam step on the global batch, the FULL
    ``optim_state_dict`` on every rank holds for ``weight`` and ``bias`` the unsharded Adam's
    entries (``step``, ``exp_avg``, ``exp_avg_sq``) and its ``step``. (The values of the 1-element
    ``exp_avg`` are not pinned: torch 2.13 gives ``exp_avg_sq``'s value there.)"""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Linear(1, 1).to(ctx.device)
    ref = copy.deepcopy(plain)
    model = fsdp(plain, use_orig_params=True, **_kwargs(ctx))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(56)
    x = torch.randn(2 * ctx.world_size, 1, generator=g).to(ctx.device)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    model(x[mine]).square().mean().backward()
    opt.step()
    ref(x).square().mean().backward()
    ref_opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fsdp.optim_state_dict(model, opt)["state"]
    want = {name: ref_opt.state[p] for name, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), (
        f"{ctx.where()} FULL optim_state_dict keys {sorted(got)}, expected {sorted(want)}"
    )
    for name, state in want.items():
        assert sorted(got[name]) == sorted(state), (
            f"{ctx.where()} FULL optim_state_dict[{name!r}]: entries {sorted(got[name])}, "
            f"expected the unsharded Adam's {sorted(state)}"
        )
        assert_close(
            ctx,
            f"FULL optim_state_dict[{name!r}]['step']",
            got[name]["step"],
            state["step"],
            FP32["param"],
        )


# ------------------------------------------------------------------------------ S57
@check(area="state_dict", requires=REQUIRES, world_sizes=(1, 2))
def fsdp1_optim_load_through_instance(ctx):
    """S57: ``optim_state_dict_to_load`` is a static method: ``model.optim_state_dict_to_load(
    model, optim, osd)`` returns what the class call does, and it loads into the optimizer
    (``use_orig_params`` True and False, one Adam step over one unit of two ``Linear(4, 4)``)."""
    for use_orig_params in (False, True):
        fsdp, model, opt = _trained(ctx, use_orig_params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            osd = fsdp.optim_state_dict(model, opt)
            want = fsdp.optim_state_dict_to_load(model, opt, copy.deepcopy(osd))
            got = model.optim_state_dict_to_load(model, opt, copy.deepcopy(osd))
        what = f"use_orig_params={use_orig_params} instance optim_state_dict_to_load"
        assert isinstance(got, dict) and sorted(got) == sorted(want), (
            f"{ctx.where()} {what} gave {type(got).__name__} with keys "
            f"{sorted(got) if isinstance(got, dict) else None}, expected {sorted(want)}"
        )
        _same_state(ctx, what, got["state"], want["state"])
        assert got["param_groups"] == want["param_groups"], (
            f"{ctx.where()} {what}: param_groups {got['param_groups']}, expected "
            f"{want['param_groups']}"
        )
        opt.load_state_dict(got)
