"""Area "state_dict": FSDP1's older optimizer-state APIs and the optimizer-state offload knobs
(S26, S24, S64).

[Note: the older optimizer-state APIs]
Before ``optim_state_dict`` / ``optim_state_dict_to_load`` (S24), FSDP1 offered one static
method per form, still public (deprecated) in torch 2.13; each gives the same state S24 does:
* ``full_optim_state_dict(model, optim, rank0_only=)``: the FULL form (FQN keys, full tensors
  equal to the unsharded optimizer's), on rank 0 only with ``rank0_only=True`` (``{}``
  elsewhere), on every rank with False; ``rank0_only`` defaults to True (S64);
* ``sharded_optim_state_dict(model, optim)``: the SHARDED form (ShardedTensors of dim-0 chunks);
* the way back into the flat optimizer, each followed by ``optim.load_state_dict``:
  ``shard_full_optim_state_dict(full_osd, model)`` (every rank holds the full dict),
  ``scatter_full_optim_state_dict(full_osd or None, model)`` (rank 0 holds it, the others pass
  None) and ``flatten_sharded_optim_state_dict(sharded_osd, model, optim)``;
* ``rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, model)`` with the unwrapped model
  keys the state by the index of each parameter in ``model.parameters()`` (what a plain
  ``torch.optim`` state dict uses), ``PARAM_NAME`` back to FQNs.
The configs' ``offload_to_cpu`` (``FullOptimStateDictConfig`` and ``ShardedOptimStateDictConfig``
default True, LOCAL's False) says where the tensors of ``optim_state_dict`` live: False leaves them
on the compute device.
"""

from __future__ import annotations

import warnings

import torch

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, full_params
from conformance.checks.state_dict.optim_state import (
    PLAN,
    REQUIRES,
    STEPS,
    Net,
    _assert_state,
    _step,
    _trained,
)
from conformance.registry import check


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation warnings of these APIs
        return fn(*args, **kwargs)


FULL_OSD_CASES = {
    "rank0_only": {"rank0_only": True},
    "every_rank": {"rank0_only": False},
    "default": {"rank0_only": None},
}


@check(area=AREA, requires=REQUIRES, cases=FULL_OSD_CASES, world_sizes=(2,))
def fsdp1_full_optim_state_dict(ctx, rank0_only):
    """S26: ``full_optim_state_dict(model, optim, rank0_only=...)`` after two Adam steps is the
    FULL form of S24 (FQN keys, full tensors equal to the unsharded optimizer's state), on rank 0
    only with ``rank0_only=True`` (``{}`` elsewhere) and on every rank with False;
    ``sharded_optim_state_dict`` is the SHARDED form. S64: ``full_optim_state_dict(model,
    optim)`` without ``rank0_only`` (case ``default``) is the ``rank0_only=True`` result: the
    FULL form on rank 0, ``{}`` on every other rank."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    oracle, oopt, model, opt = _trained(ctx)
    if rank0_only is None:
        osd = _quiet(fsdp.full_optim_state_dict, model, opt)
        rank0_only = True  # what the default must give
    else:
        osd = _quiet(fsdp.full_optim_state_dict, model, opt, rank0_only=rank0_only)
    if rank0_only and ctx.rank != 0:
        assert not osd, f"{ctx.where()} rank0_only=True: expected {{}}, got keys {sorted(osd)}"
    else:
        _assert_state(ctx, osd, oracle, oopt, True, "full_optim_state_dict")
    sosd = _quiet(fsdp.sharded_optim_state_dict, model, opt)
    _assert_state(ctx, sosd, oracle, oopt, False, "sharded_optim_state_dict")


LOAD_CASES = {"shard_full": {"via": "shard_full"}, "scatter_full": {"via": "scatter_full"}}
LOAD_CASES["flatten_sharded"] = {"via": "flatten_sharded"}
LOAD_CASES["rekeyed"] = {"via": "rekeyed"}


@check(area=AREA, requires=REQUIRES, cases=LOAD_CASES, world_sizes=(2, 4))
def fsdp1_legacy_optim_load(ctx, via):
    """S26: the trained model's optimizer state, turned back into a flat optimizer state dict by
    ``shard_full_optim_state_dict`` (every rank holds the full dict), ``scatter_full_optim_
    state_dict`` (rank 0 holds it, the others pass None), ``flatten_sharded_optim_state_dict``
    (from ``sharded_optim_state_dict``) or ``shard_full_optim_state_dict`` of the unsharded
    optimizer's own ``state_dict()`` rekeyed to FQNs (``rekey_optim_state_dict(..., PARAM_NAME,
    unwrapped model)``), loads into a fresh Adam over the model's parameters (values loaded
    from its full state dict) with the unsharded optimizer's state, and one more step gives the
    unsharded model's parameters."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    oracle, oopt, model, opt = _trained(ctx)
    values = ctx.impl.state_dict(model, "full")
    ctx.seed(5)
    fresh = ctx.impl.shard(Net().to(ctx.device), ctx, plan=PLAN)
    ctx.impl.load_state_dict(fresh, values, "full")
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    if via == "shard_full":
        full = _quiet(fsdp.full_optim_state_dict, model, opt, rank0_only=False)
        flat = _quiet(fsdp.shard_full_optim_state_dict, full, fresh)
    elif via == "scatter_full":
        full = _quiet(fsdp.full_optim_state_dict, model, opt, rank0_only=True)
        flat = _quiet(fsdp.scatter_full_optim_state_dict, full or None, fresh)
    elif via == "flatten_sharded":
        sharded = _quiet(fsdp.sharded_optim_state_dict, model, opt)
        flat = _quiet(fsdp.flatten_sharded_optim_state_dict, sharded, fresh, fopt)
    else:
        by_id = oopt.state_dict()
        by_name = _quiet(
            fsdp.rekey_optim_state_dict, by_id, ns.OptimStateKeyType.PARAM_NAME, oracle
        )
        names = sorted(n for n, _ in oracle.named_parameters())
        assert sorted(by_name["state"]) == names, (
            f"{ctx.where()} rekey to PARAM_NAME: keys {sorted(by_name['state'])}, expected {names}"
        )
        back = _quiet(fsdp.rekey_optim_state_dict, by_name, ns.OptimStateKeyType.PARAM_ID, oracle)
        assert sorted(back["state"]) == sorted(by_id["state"]), (
            f"{ctx.where()} rekey back to PARAM_ID: keys {sorted(back['state'])}, expected "
            f"{sorted(by_id['state'])} (indices into model.parameters())"
        )
        flat = _quiet(fsdp.shard_full_optim_state_dict, by_name, fresh)
    fopt.load_state_dict(flat)
    _assert_state(
        ctx,
        _quiet(fsdp.full_optim_state_dict, fresh, fopt, rank0_only=False),
        oracle,
        oopt,
        True,
        f"after loading via {via}",
    )
    _step(ctx, oracle, oopt, STEPS, sharded=False)
    _step(ctx, fresh, fopt, STEPS)
    got = full_params(ctx, fresh)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} one step after loading via {via}", got[name], ref, FP32["param"])


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"full": {"full": True}, "sharded": {"full": False}},
    world_sizes=(2,),
)
def fsdp1_optim_state_dict_offload(ctx, full):
    """S26/S24: under FULL / SHARDED with ``offload_to_cpu=False`` in the optimizer-state config
    (both default True) ``optim_state_dict`` keeps the state tensors on the compute device and
    they still equal the unsharded optimizer's (full tensors, or this rank's chunks)."""
    ns = ctx.impl.ns
    oracle, oopt, model, opt = _trained(ctx)
    if full:
        cfgs = (
            ns.StateDictType.FULL_STATE_DICT,
            ns.FullStateDictConfig(),
            ns.FullOptimStateDictConfig(offload_to_cpu=False),
        )
    else:
        cfgs = (
            ns.StateDictType.SHARDED_STATE_DICT,
            ns.ShardedStateDictConfig(),
            ns.ShardedOptimStateDictConfig(offload_to_cpu=False),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FullyShardedDataParallel.state_dict_type(model, *cfgs):
            osd = ns.FullyShardedDataParallel.optim_state_dict(model, opt)
    for name, state in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            tensors = [s.tensor for s in value.local_shards()] if not full else [value]
            for tensor in tensors:
                assert tensor.device.type == ctx.device.type, (
                    f"{ctx.where()} {name}.{key} on {tensor.device} with offload_to_cpu=False, "
                    f"expected the compute device {ctx.device}"
                )
    _assert_state(ctx, osd, oracle, oopt, full, "optim_state_dict (offload_to_cpu=False)")
