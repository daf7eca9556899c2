"""Area "fsdp1_runtime": FSDP1's state-dict and optimizer-state calls at their edges: a
``state_dict`` post-hook that drops a managed key (R86), a flat parameter holding one original
parameter (R87), ``rekey_optim_state_dict`` on keys of mixed types (R91).

[Note: state-dict calls at their edges]
* A ``state_dict`` post-hook of the wrapped module that removes a managed parameter's key makes
  ``state_dict()`` (FULL and SHARDED) fail with an error that says so: it names the missing key and
  the state dict, rather than a bare ``KeyError`` from deep inside (R86).
* An optimizer state of a ``use_orig_params=False`` unit whose flat parameter holds one original
  parameter saves and loads as any other: after ``optim_state_dict_to_load`` into a fresh model and
  Adam, the optimizer holds the unsharded Adam's state and a further step gives its parameters
  (R87).
* ``rekey_optim_state_dict`` leaves a state already keyed as asked unchanged, and refuses one
  whose keys are not all parameter names or all ids, naming the keys (R91).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _global_batch, _kwargs
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.checks.fsdp1.training import assert_params_equal_oracle
from conformance.registry import check


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


# ------------------------------------------------------------------------------ R86
def _drop_weight(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "weight")


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"full": {"kind": "full"}, "sharded": {"kind": "sharded"}},
    world_sizes=(1, 2),
)
def state_dict_hook_drops_param(ctx, kind):
    """R86: ``Linear(4, 2)`` with a ``state_dict`` post-hook that pops ``prefix + "weight"``,
    wrapped as one unit: ``state_dict()`` under FULL and SHARDED raises on every rank an error (of
    any type) whose message names the missing key ``weight`` and says ``state_dict`` (a bare
    ``KeyError('weight')`` does not)."""
    ctx.require({"full": base.FULL_STATE_DICT, "sharded": base.SHARDED_STATE_DICT}[kind])
    ctx.seed(0)
    lin = nn.Linear(4, 2).to(ctx.device)
    lin.register_state_dict_post_hook(_drop_weight)
    model = ctx.impl.ns.FullyShardedDataParallel(lin, **_kwargs(ctx))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = ctx.impl.state_dict(model, kind)
    except Exception as exc:  # noqa: BLE001 - any type, judged by its message
        said = str(exc)
        assert re.search(r"\bweight\b", said) and "state_dict" in said, (
            f"{ctx.where()} {kind} state_dict() with weight popped by a post-hook: "
            f"{type(exc).__name__} {said[:300]!r} does not say that weight is missing from the "
            "state_dict"
        )
        return
    raise AssertionError(
        f"{ctx.where()} {kind} state_dict() with weight popped by a post-hook returned "
        f"{sorted(sd)}, expected an error naming the missing weight"
    )


# ------------------------------------------------------------------------------ R87
def _one_param_unit() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_OPTIM_STATE_DICT, base.FULL_STATE_DICT},
    world_sizes=(1, 2),
)
def optim_state_one_param_flat(ctx):
    """R87: ``use_orig_params=False``, units ``0`` (a bias-free ``Linear(4, 4)``: its flat
    parameter holds one original parameter) and the root (``1``); Adam (lr 1e-2), one step on the
    global batch; ``optim_state_dict`` (FULL), then ``optim_state_dict_to_load`` into a fresh such
    model holding the stepped parameters and a fresh Adam, and ``load_state_dict``: that
    optimizer's FULL ``optim_state_dict`` holds the unsharded Adam's ``step``, ``exp_avg`` and
    ``exp_avg_sq`` under each FQN, and one more step on a second batch gives the unsharded
    model's parameters after two steps."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    plan = [("0", {}), ("", {})]
    ctx.seed(0)
    oracle = _one_param_unit().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(module, optim, salt):
        module(_global_batch(ctx, salt)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    step(oracle, oopt, 87)
    step(model, opt, 87)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
    fresh = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)  # the stepped parameters
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = first_error_everywhere(
            ctx, lambda: fsdp.optim_state_dict_to_load(fresh, fopt, osd)
        )
        fopt.load_state_dict(loaded)
        again = fsdp.optim_state_dict(fresh, fopt)
    assert_state(ctx, again, oracle, oopt, True, "loaded into a fresh Adam, saved again", None)
    step(oracle, oopt, 88)
    step(fresh, fopt, 88)
    assert_params_equal_oracle(ctx, fresh, oracle, "after a step of the loaded Adam")
