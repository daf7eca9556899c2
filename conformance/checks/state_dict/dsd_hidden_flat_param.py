"""Area "state_dict": DSD's optimizer state over an FSDP1 unit it cannot see as FSDP (S62).

[Note: a flat parameter DSD takes for a plain one]
``get_optimizer_state_dict`` keys the state by FQN. For a model it recognises as FSDP1 it asks
FSDP1's own ``optim_state_dict`` to split each flat parameter's state into its original
parameters' (S34). It recognises FSDP1 through ``FullyShardedDataParallel.fsdp_modules``, whose
traversal stops at a module another composable API owns: under ``replicate(c)`` the FSDP1 unit
inside ``c`` is not found, and DSD takes the model for a plain one, one state per registered
parameter. The unit's flat parameter (``use_orig_params=False``) stands for its four original
parameters, so no single FQN is right for its state: DSD must refuse (torch 2.13: AssertionError
"Expected 1 FQN for key '0.0._fsdp_wrapped_module._flat_param', got 4") rather than file the
whole flat state under one of the four names. A dict keyed by exactly the four FQNs would be
right too; with ``full_state_dict=True`` each must then hold the unsharded Adam's state of that
parameter.

The step uses gradients set by hand (ones) rather than a forward through ``replicate``: what is
checked is only how the optimizer's state is keyed, and the unsharded Adam gets the same gradients.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.sd_models import AREA
from conformance.registry import check

REQUIRES = {base.DCP_HELPERS, base.FSDP1_API, base.FLAT_PARAM}


def _adam_step(model: nn.Module) -> torch.optim.Optimizer:
    """One Adam step of ``model`` 's parameters with every gradient set to ones."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _no_local_piece(name, key, value, full_value):
    raise AssertionError(f"{key} of {name}: only full_state_dict=True values are compared")


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"full": {"full": True}, "sharded": {"full": False}},
    world_sizes=(1, 2),
)
def dsd_hidden_flat_param_optim(ctx, full):
    """S62: ``get_optimizer_state_dict`` over ``Sequential(c)``, ``c = Sequential(FSDP(
    Sequential(Linear(4,4), Linear(4,4))))`` (``use_orig_params=False``) annotated with
    ``replicate(c)`` (so ``FSDP.fsdp_modules`` finds no unit), after an Adam step, refuses
    (raises; torch 2.13: AssertionError "Expected 1 FQN ...") or keys the state by exactly the
    four original FQNs (with ``full_state_dict=True`` each the unsharded Adam's state), never
    the flat parameter's state under one of them."""
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed._composable import replicate

    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))))
    oracle = oracle.to(ctx.device)
    inner = ctx.impl.shard(copy.deepcopy(oracle[0][0]), ctx, use_orig_params=False)
    c = nn.Sequential(inner)
    replicate(c)
    model = nn.Sequential(c)
    assert not fsdp.fsdp_modules(model), (
        f"{ctx.where()} precondition: FSDP.fsdp_modules finds {len(fsdp.fsdp_modules(model))} "
        "unit(s) under the replicate()-annotated module; the case needs none"
    )
    opt, oopt = _adam_step(model), _adam_step(oracle)
    names = sorted(n for n, _ in oracle.named_parameters())
    try:
        osd = dsd.get_optimizer_state_dict(
            model, opt, options=dsd.StateDictOptions(full_state_dict=full)
        )
    except Exception:  # noqa: BLE001 - a refusal (any exception) is the rule's first form
        return
    keys = sorted(osd.get("state", {}))
    assert keys == names, (
        f"{ctx.where()} get_optimizer_state_dict over a flat parameter DSD sees as plain "
        f"returned state keyed {keys}; expected a refusal or exactly the original FQNs {names} "
        "(one FQN cannot stand for the flat parameter's whole state)"
    )
    if full:
        assert_state(ctx, osd, oracle, oopt, True, "get_optimizer_state_dict", _no_local_piece)
