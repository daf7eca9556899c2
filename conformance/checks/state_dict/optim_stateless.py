"""Area "state_dict": FULL optimizer state dicts in which some parameters of one flat parameter have
no state, loaded by ``optim_state_dict_to_load`` or ``shard_full_optim_state_dict`` (S35,
S26).

[Note: parameters without state in a flat parameter]
A FULL dict in which some parameters of one flat parameter have state and others none (unused
parameters the unsharded optimizer never stepped) is refused with ValueError (they disagree on
``step``); with tensor state only (SGD's momentum) the stateless parameter's part is filled with
zeros, which is what no momentum means. The models, optimizers and helpers are
``optim_groups.py``'s (see its Notes).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.checks.state_dict.optim_groups import (
    PLAN,
    REQUIRES,
    STEPS,
    _context,
    _osd,
    _quiet,
    _step,
)
from conformance.registry import check


class SpareNet(InnerHeadNet):
    """InnerHeadNet with parameters in the root's unit that the forward never reads, so the
    unsharded optimizer never gives them state: ``spare`` (3,) on the root itself (first in the
    unit's flat parameter: a module's own parameters come before its children's) or a Linear(3, 3)
    ``tail`` registered after ``head`` (last)."""

    def __init__(self, where: str):
        super().__init__()
        if where == "first":
            self.spare = nn.Parameter(torch.zeros(3))
        else:
            self.tail = nn.Linear(3, 3)


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"stateless-last": {"where": "last"}, "stateless-first": {"where": "first"}},
    world_sizes=(2,),
)
def fsdp1_optim_load_stateless_param(ctx, where):
    """S35: the unsharded optimizer's own ``state_dict()`` rekeyed to FQNs
    (``rekey_optim_state_dict(..., PARAM_NAME, unsharded model)``), in which the root unit's
    unused parameters (first or last in its flat parameter) have no state while the unit's other
    parameters have theirs, is refused by ``optim_state_dict_to_load`` under FULL with ValueError
    (the unit's parameters disagree on the scalar state ``step``) on every rank."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = SpareNet(where).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
    unused = [n for n, p in oracle.named_parameters() if p not in oopt.state]
    assert unused and all(not n.startswith(("inner", "head")) for n in unused), (
        f"{ctx.where()} setup: parameters without state {unused}, expected the unused ones"
    )
    by_name = _quiet(
        ns.FullyShardedDataParallel.rekey_optim_state_dict,
        oopt.state_dict(),
        ns.OptimStateKeyType.PARAM_NAME,
        oracle,
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _context(ctx, model, "full"):
                ns.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, by_name)
    except ValueError as exc:
        assert "scalar state with the same value" in str(exc), (
            f"{ctx.where()} ValueError {str(exc)[:160]!r}, expected it to say the unit's "
            "parameters disagree on their scalar state"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict_to_load accepted a dict in which {unused} have no "
            "state next to the other parameters of their flat parameter; expected ValueError"
        )


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"optim_state_dict_to_load": {"via": "to_load"}, "shard_full": {"via": "shard_full"}},
    world_sizes=(2,),
)
def fsdp1_optim_load_stateless_momentum(ctx, via):
    """S35: a FULL dict whose state is tensors only (SGD's ``momentum_buffer``, no scalar
    ``step``), taken from the unsharded optimizer and rekeyed to FQNs, in which the root unit's
    unused ``tail`` (after ``head`` in its flat parameter) has no state, loads through
    ``optim_state_dict_to_load`` (or the older ``shard_full_optim_state_dict``, S26) into the
    flat optimizer: read back, the other parameters hold the unsharded optimizer's momentum and
    ``tail`` none or zeros (a zero momentum is no momentum), and one more step gives the unsharded
    model's parameters."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = SpareNet("last").to(ctx.device)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
    unused = [n for n, p in oracle.named_parameters() if p not in oopt.state]
    assert unused == ["tail.weight", "tail.bias"], (
        f"{ctx.where()} setup: parameters without state {unused}, expected tail's"
    )
    by_name = _quiet(
        fsdp.rekey_optim_state_dict, oopt.state_dict(), ns.OptimStateKeyType.PARAM_NAME, oracle
    )
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if via == "to_load":
        with _context(ctx, model, "full"):
            flat = _quiet(fsdp.optim_state_dict_to_load, model, opt, by_name)
    else:
        flat = _quiet(fsdp.shard_full_optim_state_dict, by_name, model)
    opt.load_state_dict(flat)
    state = _osd(ctx, model, opt, "full", offload=False)["state"]
    for name, p in oracle.named_parameters():
        what = f"{name}.momentum_buffer loaded via {via}"
        if name in unused:
            got = state.get(name, {}).get("momentum_buffer")
            assert got is None or not got.any(), (
                f"{ctx.where()} {what}: {got}, expected none or zeros (no state in the dict)"
            )
            continue
        assert name in state, f"{ctx.where()} {what}: no state after the load"
        want = oopt.state[p]["momentum_buffer"]
        assert_close(ctx, what, state[name]["momentum_buffer"], want, FP32["grad"])
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, model, opt, STEPS)
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} one step after the load", got[name], ref, FP32["param"])
