"""Area "fuzz": random models and settings against the single-process oracle (differential fuzzing).

Each check below (and in :mod:`.state_dict`) is run by hypothesis in the driver (see
:mod:`conformance.fuzz`): its body gets one drawn ``example`` (a plain dict,
:mod:`conformance.fuzz.model`) on every rank. Expected values come from the rules and from the
oracle (see :mod:`._common`), never from the implementation under test. What each check's examples
leave out, for which deviation sets, is :mod:`._drops`.
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import full_params
from conformance.checks.fuzz._common import (
    NO_TRAINING,
    _kind,
    assert_per_param_layout,
    assert_restored,
    assert_trained,
    gathered,
    oracle_params,
    saved_values,
    shard,
    shard_groups,
    train,
)
from conformance.checks.fuzz._drops import TRAIN_PARITY_DROPS
from conformance.fuzz import fuzz_check
from conformance.fuzz import strategies as fs
from conformance.registry import check


@fuzz_check(features=NO_TRAINING)
@check(area="fuzz")
def layout(ctx, example):
    """Every parameter of a random model sits where the layout rule puts it: dim-0 (or the placed
    dim's) chunk of ceil(d/ws), or elements [r*ceil(N/ws), ...) of its unit's flat parameter with
    zero padding, over the unit's shard group (the world size, or one rank under FSDP1's
    NO_SHARD); the all-gathered parameters equal the originals (P1, P7, P13, R19)."""
    model, oracle = shard(ctx, example)
    originals = oracle_params(oracle)
    if base.PER_PARAM_DIM0 in ctx.impl.capabilities:
        assert_per_param_layout(ctx, model, originals, example)
    elif base.FLAT_PARAM in ctx.impl.capabilities:
        seen = []
        groups = shard_groups(example, oracle, ctx.world_size)  # R19: 1 under NO_SHARD
        for fqns, shard_ in ctx.impl.flat_shards(model):
            order = [f for f in originals if f in fqns]
            assert fqns == order, (
                f"{ctx.where()} flat parameter order {fqns}, expected registration order {order}"
            )
            flat = torch.cat([originals[f].reshape(-1) for f in fqns]) if fqns else torch.zeros(0)
            group = groups.get(fqns[0], ctx.world_size) if fqns else ctx.world_size
            start, end, chunk = flat_range(flat.numel(), group, ctx.rank % group)
            got = shard_.detach().cpu()
            assert got.numel() == chunk and torch.equal(got[: end - start], flat[start:end]), (
                f"{ctx.where()} flat parameter of {fqns}: shard of {got.numel()} elements "
                f"{got[:4].tolist()}, expected elements {start}:{end} of {flat.numel()} padded to "
                f"{chunk} (a shard group of {group})"
            )
            assert not got[end - start :].any(), (
                f"{ctx.where()} flat parameter of {fqns}: padding not zero"
            )
            seen += fqns
        assert sorted(seen) == sorted(originals), (
            f"{ctx.where()} flattened parameters {sorted(seen)} != the model's {sorted(originals)}"
        )
    else:
        raise NotSupported.undeclared(base.PER_PARAM_DIM0, base.FLAT_PARAM, any_of=True)
    reassembled = full_params(ctx, model)
    for fqn, orig in originals.items():
        if example.get("placements", {}).get(fqn, 0) == 0:  # full_params reads dim-0 views
            assert torch.equal(reassembled[fqn], orig), (
                f"{ctx.where()} {fqn}: reassembled from the ranks' shards, it differs from the original"
            )
    if base.DTENSOR_PARAMS in ctx.impl.capabilities:
        for fqn, full in gathered(ctx, model).items():
            assert torch.equal(full, originals[fqn]), (
                f"{ctx.where()} {fqn}: full_tensor() differs from the original"
            )


@fuzz_check(features=fs.ALL_FEATURES - {fs.ASSIGN}, drops=TRAIN_PARITY_DROPS)
@check(area="fuzz", requires={base.TRAINING})
def train_parity(ctx, example):
    """A random model trained 2-3 SGD steps, each rank on its slice of the global batch, has the
    oracle's per-rank losses and, after the steps, the oracle's parameters; also on an HSDP
    (replicate, shard) mesh and with per-unit gradient divide factors, whose oracle gradient is the
    ranks' summed gradient divided by the factor; with FSDP1's per-unit sharding strategies and
    prefetch knobs, and with micro-batches under ``no_sync()`` before each synced one, whose
    oracle gradient is the sum over the micro-batches (P6, P7, P16, R19, R45)."""
    model, oracle = shard(ctx, example)
    before = oracle_params(oracle)
    train(ctx, model, oracle, example, example["steps"])
    assert_trained(ctx, example, model, oracle, before, example["steps"])


def _partner(impl):
    """The other layout's reference implementation (another adapter in this process)."""
    from conformance.adapters.registry import load_implementation

    name = "reference-fsdp1" if base.PER_PARAM_DIM0 in impl.capabilities else "reference"
    return load_implementation(name)


# cross_load saves FULL dicts on every rank (no rank0_only) and builds the partner without the
# example's options (plain), so mixed precision and CPU offload are state_dict_round_trip's; ties
# are kept: tied examples pass on all four built-ins (measured at ws 1-2)
@fuzz_check(
    features=fs.ALL_FEATURES
    - {fs.MIXED_PRECISION, fs.CPU_OFFLOAD, fs.RANK0_ONLY, fs.ASSIGN, fs.HSDP, fs.DIVIDE_FACTOR}
    - {fs.PREFETCH, fs.ACCUMULATE, fs.FSDP1_HSDP}
)
@check(area="fuzz", requires={base.TRAINING})
def cross_load(ctx, example):
    """A full state dict saved by the implementation loads into the other layout's reference
    (FSDP2 <-> FSDP1), and the reference's into the implementation, restoring every value (S2, S19, P8)."""
    partner = _partner(ctx.impl)
    model, oracle = shard(ctx, example)
    train(ctx, model, oracle, example, 1)
    expected = saved_values(ctx, example, model, oracle)
    saved = ctx.impl.state_dict(model, _kind(ctx.impl, "full"))
    other, _ = shard(ctx, example, salt=1, impl=partner, plain=True)
    partner.load_state_dict(other, saved, _kind(partner, "full"))
    assert_restored(
        ctx,
        other,
        expected,
        f"{partner.name} after loading {ctx.impl.name}'s full state dict",
        impl=partner,
    )
    back = partner.state_dict(other, _kind(partner, "full"))
    fresh, _ = shard(ctx, example, salt=2)
    ctx.impl.load_state_dict(fresh, back, _kind(ctx.impl, "full"))
    assert_restored(ctx, fresh, expected, f"after loading {partner.name}'s full state dict")
