"""Area "state_dict": FSDP1's optimizer state dicts, FULL and SHARDED (S24).

[Note: FSDP1 optimizer state under each type]
The optimizer of an FSDP1 model steps the flat parameters; ``FullyShardedDataParallel.
optim_state_dict(model, optim)`` translates its state back to the original parameters, keyed by
their FQNs (``inner.weight``, ...; also the ``params`` of each param group), under the type set
with ``state_dict_type(model, type, state_dict_config, optim_state_dict_config)``:
* FULL (``FullOptimStateDictConfig``): per parameter plain tensors of its full shape equal to the
  unsharded optimizer's after the same steps (Adam: ``exp_avg``, ``exp_avg_sq``; ``step`` equal);
  with ``rank0_only=True`` rank 0 gets that dict and every other rank ``{}``;
* SHARDED (``ShardedOptimStateDictConfig``): ``exp_avg`` / ``exp_avg_sq`` are ShardedTensors
  holding the rank's ``torch.chunk(state, ws, 0)[rank]`` at row offset ``ceil(d0/ws)*rank``
  (no local shard past the last chunk), as S5 does for the parameters; ``step`` stays a tensor.
``optim_state_dict_to_load(model, optim, osd)`` turns such a dict back into the flat optimizer's
(under FULL ``rank0_only`` only rank 0 passes the dict, the others ``{}``), and
``optim.load_state_dict`` of it into a freshly built model and optimizer restores the state: one
more step then gives the unsharded model's parameters.

The oracle is the unsharded model with its own Adam, fed every global batch (mean losses).
"""

from __future__ import annotations

import copy
import warnings

import torch

from conformance.adapters import base
from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_size
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.registry import check

REQUIRES = {base.FSDP1_OPTIM_STATE_DICT, base.FSDP1_API, base.FLAT_PARAM, base.TRAINING}
B = 2
STEPS = 2
PLAN = [("inner", {}), ("", {})]


Net = InnerHeadNet  # inner its own unit, head the root's (PLAN)


def _step(ctx, model, opt, step, sharded=True):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    if sharded:
        x = x[ctx.rank * B : (ctx.rank + 1) * B]
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _trained(ctx):
    ctx.seed(0)
    oracle = Net().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step, sharded=False)
        _step(ctx, model, opt, step)
    return oracle, oopt, model, opt


def _context(ctx, model, full, rank0_only):
    ns = ctx.impl.ns
    if full:
        return ns.FullyShardedDataParallel.state_dict_type(
            model,
            ns.StateDictType.FULL_STATE_DICT,
            ns.FullStateDictConfig(rank0_only=rank0_only),
            ns.FullOptimStateDictConfig(rank0_only=rank0_only),
        )
    return ns.FullyShardedDataParallel.state_dict_type(
        model,
        ns.StateDictType.SHARDED_STATE_DICT,
        ns.ShardedStateDictConfig(),
        ns.ShardedOptimStateDictConfig(),
    )


def _optim_state_dict(ctx, model, opt, full, rank0_only):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation warnings
        with _context(ctx, model, full, rank0_only):
            return ctx.impl.ns.FullyShardedDataParallel.optim_state_dict(model, opt)


def _local_piece(ctx, name, key, value, rows):
    """The rank's piece of a SHARDED state entry, checked against S5's offset rule."""
    shards = value.local_shards()
    if not shards:
        return None
    assert len(shards) == 1, f"{ctx.where()} {name}.{key}: {len(shards)} local shards, expected 1"
    offset = shards[0].metadata.shard_offsets[0]
    assert offset == chunk_size(rows, ctx.world_size) * ctx.rank, (
        f"{ctx.where()} {name}.{key}: local shard at row {offset}, expected "
        f"{chunk_size(rows, ctx.world_size) * ctx.rank}"
    )
    return shards[0].tensor


def _assert_state(ctx, osd, oracle, oopt, full, what):
    """``osd`` holds the oracle optimizer's state under FQNs: full tensors or, sharded,
    ShardedTensors of this rank's chunks at its row offset."""

    def local_piece(name, key, value, full_value):
        assert hasattr(value, "local_shards"), (
            f"{ctx.where()} {what} {name}.{key}: {type(value).__name__}, expected a ShardedTensor"
        )
        return _local_piece(ctx, name, key, value, full_value.shape[0])

    assert_state(ctx, osd, oracle, oopt, full, what, local_piece)


CASES = {
    "full": {"full": True, "rank0_only": False},
    "full-rank0_only": {"full": True, "rank0_only": True},
    "sharded": {"full": False, "rank0_only": False},
}


@check(area=AREA, requires=REQUIRES, cases=CASES, world_sizes=(2, 4))
def fsdp1_optim_state_dict(ctx, full, rank0_only):
    """S24: after two Adam steps ``FullyShardedDataParallel.optim_state_dict`` under FULL gives
    FQN-keyed plain full tensors equal to the unsharded optimizer's state (``rank0_only``: on rank
    0, ``{}`` elsewhere), under SHARDED ShardedTensors of this rank's dim-0 chunks at offset
    ``ceil(d0/ws)*rank``; ``step`` equals the unsharded optimizer's."""
    oracle, oopt, model, opt = _trained(ctx)
    osd = _optim_state_dict(ctx, model, opt, full, rank0_only)
    if rank0_only and ctx.rank != 0:
        assert not osd, f"{ctx.where()} rank0_only: expected {{}}, got keys {sorted(osd)}"
        return
    _assert_state(
        ctx, osd, oracle, oopt, full, f"optim_state_dict ({'full' if full else 'sharded'})"
    )


@check(area=AREA, requires=REQUIRES, cases=CASES, world_sizes=(2, 4))
def fsdp1_optim_state_dict_load(ctx, full, rank0_only):
    """S24: the optimizer state dict of the trained model (with the model's own state dict of the
    same type, on every rank), loaded into a freshly built FSDP1 model and Adam through ``load_state_dict`` and
    ``optim_state_dict_to_load`` (under FULL ``rank0_only`` rank 0 alone passes the optimizer dict), gives
    back the unsharded optimizer's state, and one more step gives the unsharded model's
    parameters after three steps."""
    oracle, oopt, model, opt = _trained(ctx)
    osd = _optim_state_dict(ctx, model, opt, full, rank0_only)
    kind = "full" if full else "sharded"
    msd = ctx.impl.state_dict(model, kind)  # the model's values on every rank (S2/S5)
    ctx.seed(5)
    fresh = ctx.impl.shard(Net().to(ctx.device), ctx, plan=PLAN)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    ctx.impl.load_state_dict(fresh, msd, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, fresh, full, rank0_only):
            flat = ctx.impl.ns.FullyShardedDataParallel.optim_state_dict_to_load(
                fresh, fopt, osd if osd else {}
            )
    fopt.load_state_dict(flat)
    _assert_state(
        ctx, _optim_state_dict(ctx, fresh, fopt, True, False), oracle, oopt, True, "after the load"
    )
    _step(ctx, oracle, oopt, STEPS, sharded=False)
    _step(ctx, fresh, fopt, STEPS)
    got = full_params(ctx, fresh)
    for name, ref in oracle.named_parameters():
        assert_close(
            ctx,
            f"{name} after loading and one more step (vs the unsharded model after {STEPS + 1})",
            got[name],
            ref,
            FP32["param"],
        )
