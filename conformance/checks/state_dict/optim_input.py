"""Area "state_dict": FSDP1's older optimizer-state APIs given ``optim_input=`` instead of the
optimizer, and the FULL dict they give (S39).

[Note: optim_input]
A plain ``torch.optim`` optimizer keys its ``state_dict()`` by the index of each parameter in
its param groups (0, 1, ... across the groups in order); FSDP1's APIs translate that to the
original parameters' FQNs (S24) and back (``optim_keys.py``'s Note). The older APIs
(``full_optim_state_dict``, ``shard_full_optim_state_dict``, ``rekey_optim_state_dict``) take what
the optimizer was built from instead of the optimizer: the list of its parameters or the list of
its param-group dicts (index = position across the groups). Either gives the same dict as the
optimizer itself; an empty list is refused with ValueError ("... should not be empty"), a list
mixing parameters and dicts with TypeError ("... Tensors or dicts"). No tensor of a FULL dict
serves two parameters, so a plain optimizer that loads it (after ``rekey_optim_state_dict(...,
PARAM_ID, ...)``) steps each on its own.
"""

from __future__ import annotations

import copy

import torch

from conformance.checks._shared.sd_models import AREA
from conformance.checks.state_dict.optim_groups import (
    REQUIRES,
    CountingAdam,
    _assert_osd,
    _build,
    _groups,
    _quiet,
    _trained,
)
from conformance.checks.state_dict.optim_keys import _assert_steps_like
from conformance.registry import check


def _input_form(model, form):
    """What ``model``'s two-group optimizer (``_groups``) was built from: its parameters in
    group order, or fresh param-group dicts."""
    groups = _groups(model.named_parameters())
    if form == "params":
        return [p for g in groups for p in g["params"]]
    return groups


def _unshared(sd):
    """``sd`` with every state tensor cloned (no tensor shared between two entries)."""
    state = {
        k: {n: v.clone() if torch.is_tensor(v) else v for n, v in entry.items()}
        for k, entry in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"params": {"form": "params"}, "groups": {"form": "groups"}},
    world_sizes=(1, 2),
)
def fsdp1_optim_input_forms(ctx, form):
    """S39: ``optim_input=`` (the optimizer's parameters in group order, or its param-group
    dicts) instead of the optimizer: ``full_optim_state_dict`` gives the unsharded optimizer's
    FQN-keyed state and groups; ``rekey_optim_state_dict(..., PARAM_ID / PARAM_NAME, unwrapped
    model, optim_input=)`` keys by the unsharded optimizer's indices / back by FQN, and the
    index-keyed dict loads into a plain optimizer; ``shard_full_optim_state_dict(full, fresh model,
    optim_input=)`` loads into a fresh sharded one; one more step of each gives the unsharded
    model's parameters."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    oracle, oopt, model, opt = _trained(ctx)
    full = _quiet(
        fsdp.full_optim_state_dict,
        model,
        opt,
        optim_input=_input_form(model, form),
        rank0_only=False,
    )
    _assert_osd(ctx, full, oracle, oopt, True, f"full_optim_state_dict(optim_input={form})")

    by_id = _quiet(
        fsdp.rekey_optim_state_dict,
        full,
        ns.OptimStateKeyType.PARAM_ID,
        oracle,
        optim_input=_input_form(oracle, form),
    )
    want = oopt.state_dict()
    assert sorted(by_id["state"]) == sorted(want["state"]), (
        f"{ctx.where()} rekey to PARAM_ID (optim_input={form}): keys {sorted(by_id['state'])}, "
        f"expected the unsharded optimizer's indices {sorted(want['state'])}"
    )
    assert [sorted(g["params"]) for g in by_id["param_groups"]] == [
        sorted(g["params"]) for g in want["param_groups"]
    ], f"{ctx.where()} rekey to PARAM_ID: groups {by_id['param_groups']}, expected {want}"
    by_name = _quiet(
        fsdp.rekey_optim_state_dict,
        want,
        ns.OptimStateKeyType.PARAM_NAME,
        oracle,
        optim_input=_input_form(oracle, form),
    )
    _assert_osd(ctx, by_name, oracle, oopt, True, f"rekey to PARAM_NAME (optim_input={form})")

    plain = copy.deepcopy(oracle)
    popt = CountingAdam(_groups(plain.named_parameters()))
    # one 0-dim ``step`` tensor may serve every parameter of a flat parameter in the FULL dict
    # (torch 2.13), and a plain optimizer loads it uncopied: give each entry its own
    popt.load_state_dict(_unshared(by_id))
    msd = ctx.impl.state_dict(model, "full")
    _, fresh = _build(ctx, "groups", False)
    ctx.impl.load_state_dict(fresh, msd, "full")
    fopt = CountingAdam(_groups(fresh.named_parameters()))
    flat = _quiet(
        fsdp.shard_full_optim_state_dict, full, fresh, optim_input=_input_form(fresh, form)
    )
    fopt.load_state_dict(flat)
    back = _quiet(fsdp.full_optim_state_dict, fresh, fopt, rank0_only=False)
    _assert_osd(ctx, back, oracle, oopt, True, f"after shard_full_optim_state_dict({form})")
    _assert_steps_like(
        ctx, oracle, oopt, [(plain, popt, False), (fresh, fopt, True)], f"loading ({form})"
    )


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_input_refused(ctx):
    """S39: ``full_optim_state_dict(model, optim, optim_input=[])`` raises ValueError saying the
    input is empty; ``optim_input`` mixing a parameter and a param-group dict raises TypeError
    saying it must be Tensors or dicts."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    _, _, model, opt = _trained(ctx)
    params = list(model.parameters())
    for bad, exc_type, words in (
        ([], ValueError, "empty"),
        ([params[0], {"params": params[1:]}], TypeError, "Tensors or dicts"),
    ):
        try:
            _quiet(fsdp.full_optim_state_dict, model, opt, optim_input=bad, rank0_only=False)
        except exc_type as exc:
            assert words in str(exc), (
                f"{ctx.where()} optim_input={bad!r:.60}: {exc_type.__name__} {str(exc)[:160]!r}, "
                f"expected it to say {words!r}"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} full_optim_state_dict accepted optim_input={bad!r:.60}; "
                f"expected {exc_type.__name__}"
            )


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_full_entries_unshared(ctx):
    """S39: no tensor of ``full_optim_state_dict``'s FULL dict serves two parameters' entries
    (each parameter's ``step`` is its own tensor), so the documented flow, ``rekey_optim_state_dict
    (full, PARAM_ID, unwrapped model)`` then a plain optimizer's ``load_state_dict`` (which keeps
    ``step`` uncopied), trains as the unsharded optimizer: one more step gives its parameters."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    oracle, oopt, model, opt = _trained(ctx)
    full = _quiet(fsdp.full_optim_state_dict, model, opt, rank0_only=False)
    seen = {}
    for name, entry in full["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                other = seen.setdefault(id(value), f"{name}.{key}")
                assert other == f"{name}.{key}", (
                    f"{ctx.where()} full_optim_state_dict: {other} and {name}.{key} are one tensor "
                    "object, expected each entry its own"
                )
    by_id = _quiet(fsdp.rekey_optim_state_dict, full, ns.OptimStateKeyType.PARAM_ID, oracle)
    plain = copy.deepcopy(oracle)
    popt = CountingAdam(_groups(plain.named_parameters()))
    popt.load_state_dict(by_id)
    _assert_steps_like(ctx, oracle, oopt, [(plain, popt, False)], "the rekeyed FULL dict's load")
