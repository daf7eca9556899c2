"""Area "fuzz" (continued): random models' state dicts (FULL, SHARDED, LOCAL; FSDP2's own DTensor
dict with ``assign=True``) against the oracle's values. See :mod:`.fuzz`."""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks._shared.rows import chunk_size, flat_range
from conformance.checks._shared.sd_models import assert_entry, broadcast_from_rank0
from conformance.checks.fuzz._common import (
    _kind,
    assert_per_param_layout,
    assert_restored,
    assert_trained,
    flat_units,
    name_groups,
    oracle_params,
    placement_dims,
    saved_buffers,
    saved_values,
    shard,
    shard_groups,
    train,
)
from conformance.checks.fuzz._drops import SD_ROUND_TRIP_DROPS
from conformance.fuzz import fuzz_check
from conformance.fuzz import model as fm
from conformance.fuzz import strategies as fs
from conformance.registry import check


def local_expected(ctx, example: dict, oracle, values: dict) -> dict:
    """What a LOCAL dict must hold for ``example`` at ws >= 2 (S7): per unit that manages parameters
    and shards them ``<unit>._flat_param`` (``_flat_param`` for the root) -> (unpadded flat numel N,
    this rank's elements ``[r*ceil(N/ws), min((r+1)*ceil(N/ws), N))``), the flat parameter being
    the unit's managed parameters (``values``, under their first names) flattened and concatenated
    in registration order. A NO_SHARD unit's parameters are saved FULL instead (S8): see
    :func:`no_shard_entries`."""
    out = {}
    groups = shard_groups(example, oracle, ctx.world_size)
    for unit, fqns in fm.managed(oracle, flat_units(example, oracle)).items():
        if not fqns or groups[fqns[0]] == 1:
            continue  # a unit without parameters has no flat parameter; NO_SHARD: S8
        flat = torch.cat([values[f].reshape(-1) for f in fqns])
        start, end, _ = flat_range(flat.numel(), ctx.world_size, ctx.rank)
        out[f"{unit}._flat_param" if unit else "_flat_param"] = (flat.numel(), flat[start:end])
    return out


def no_shard_entries(ctx, example: dict, oracle, expected: dict) -> dict:
    """The entries of ``expected`` (every parameter name, tied aliases too, and the persistent
    buffers) that a SHARDED or LOCAL dict holds as a FULL one does: those of units that do not
    shard (FSDP1 NO_SHARD, S8), buffers in their own dtype (S12)."""
    if base.FLAT_PARAM not in ctx.impl.capabilities:
        return {}
    groups = name_groups(example, oracle, ctx.world_size)
    return {n: v for n, v in expected.items() if groups.get(n) == 1}


def assert_local_dict(ctx, sd: dict, buffers: dict, flats: dict) -> None:
    """``sd`` (a LOCAL dict) has one ``_flat_param`` key per unit that manages parameters (``flats``,
    from :func:`local_expected`), each a 1-D ShardedTensor of the unpadded numel with this rank's
    elements at offset ``r*ceil(N/ws)`` (none on a pure-padding rank), and ``buffers``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    want = set(flats) | set(buffers)
    assert set(sd) == want, (
        f"{ctx.where()} local state-dict keys: missing {sorted(want - set(sd))}, "
        f"unexpected {sorted(set(sd) - want)}"
    )
    for name, value in buffers.items():
        assert_entry(ctx, name, sd[name], value, full=True)
    for key, (numel, local) in flats.items():
        got = sd[key]
        assert isinstance(got, ShardedTensor), (
            f"{ctx.where()} {key}: {type(got).__name__}, expected a ShardedTensor"
        )
        size = tuple(got.metadata().size)
        assert size == (numel,), (
            f"{ctx.where()} {key}: global size {size}, expected ({numel},), the unpadded numel"
        )
        shards = got.local_shards()
        if not local.numel():
            assert not shards or not shards[0].tensor.numel(), (
                f"{ctx.where()} {key}: a pure-padding rank holds {len(shards)} local shard(s)"
            )
            continue
        assert len(shards) == 1, f"{ctx.where()} {key}: {len(shards)} local shards, expected 1"
        offset = list(shards[0].metadata.shard_offsets)
        chunk = chunk_size(numel, ctx.world_size)
        assert offset == [chunk * ctx.rank], (
            f"{ctx.where()} {key}: local shard at offset {offset}, expected [{chunk * ctx.rank}]"
        )
        mine = shards[0].tensor.detach().cpu()
        assert mine.shape == local.shape and torch.equal(mine, local), (
            f"{ctx.where()} {key}: local shard {mine[:4].tolist()} (numel {mine.numel()}), expected "
            f"flat elements {chunk * ctx.rank}:{chunk * ctx.rank + local.numel()} of {numel} "
            f"{local[:4].tolist()}"
        )


@fuzz_check(
    features=fs.ALL_FEATURES
    - {fs.CPU_OFFLOAD, fs.HSDP, fs.DIVIDE_FACTOR, fs.PREFETCH, fs.ACCUMULATE, fs.FSDP1_HSDP},
    drops=SD_ROUND_TRIP_DROPS,
    case_requires={"local": {base.LOCAL_STATE_DICT}},
)
@check(
    area="fuzz",
    requires={base.TRAINING},
    cases={"full": {"kind": "full"}, "sharded": {"kind": "sharded"}, "local": {"kind": "local"}},
)
def state_dict_round_trip(ctx, example, kind):
    """After a training step, a random model's FULL (SHARDED) state dict holds its parameters (this
    rank's dim-0 chunk) under clean keys and its persistent buffers in their own dtype, never the
    non-persistent ones (with ``rank0_only``: on rank 0, the others get ``{}``); a LOCAL dict (FSDP1)
    holds per unit this rank's chunk of the flat parameter, its managed parameters flattened in
    registration order; each loads into a freshly built model with other values, restoring them
    (with the ``assign`` feature, FSDP2's own DTensor dict loads with ``assign=True``: new sharded
    Parameters, re-padded, and one more step matches the oracle) (S2, S3, S5, S7, S8, S12, P8, P9)."""
    impl_kind = _kind(ctx.impl, kind)
    model, oracle = shard(ctx, example)
    train(ctx, model, oracle, example, 1)
    expected = saved_values(ctx, example, model, oracle)
    if kind == "local" and ctx.world_size > 1:  # at ws 1 FSDP1 keeps every kind FULL (S8)
        params = dict(oracle.named_parameters())  # first names only: a flat parameter's members
        flats = local_expected(ctx, example, oracle, {f: expected[f] for f in params})
        whole = no_shard_entries(ctx, example, oracle, expected)  # buffers FULL there too
        sd = ctx.impl.state_dict(model, impl_kind)
        buffers = saved_buffers(example, oracle, restore_dtype=False)
        assert_local_dict(ctx, sd, {**buffers, **whole}, flats)
        fresh, _ = shard(ctx, example, salt=1)
        ctx.impl.load_state_dict(fresh, sd, impl_kind)
        assert_restored(ctx, fresh, expected, "after loading the local state dict")
        return
    config = {"rank0_only": True} if example.get("rank0_only") and kind == "full" else {}
    sd = ctx.impl.state_dict(model, impl_kind, **config)
    if config:
        assert ctx.rank == 0 or sd == {}, (
            f"{ctx.where()} rank0_only: {len(sd)} entries on a rank other than 0, expected none"
        )
        sd = broadcast_from_rank0(ctx, sd)  # rank 0's dict, checked and loaded everywhere
    assert set(sd) == set(expected), (
        f"{ctx.where()} {impl_kind} state-dict keys: missing {sorted(set(expected) - set(sd))}, "
        f"unexpected {sorted(set(sd) - set(expected))}"
    )
    dims = placement_dims(example, oracle)
    full = impl_kind in ("full", "dcp-full") or (
        ctx.world_size == 1 and base.FLAT_PARAM in ctx.impl.capabilities
    )
    whole = no_shard_entries(ctx, example, oracle, expected)  # S8
    for name, value in expected.items():
        if name in dims and not full and dims[name] != 0:
            continue  # a Shard(d) entry: checked through the load below
        assert_entry(ctx, name, sd[name], value, full=full or name not in dims or name in whole)
    fresh, _ = shard(ctx, example, salt=1)
    if example.get("assign") and impl_kind == "dtensor":
        assign_and_train(ctx, example, fresh, sd, expected, oracle)
        return
    ctx.impl.load_state_dict(fresh, sd, impl_kind)
    assert_restored(ctx, fresh, expected, f"after loading the {impl_kind} state dict")


def assign_and_train(ctx, example: dict, fresh, sd: dict, expected: dict, oracle) -> None:
    """``fresh.load_state_dict(sd, assign=True)`` (FSDP2 API, ``sd`` the trained model's own DTensor
    dict): every parameter is a new Parameter, a DTensor on the mesh with its placement (Shard(0)
    or the example's), holding its chunk of the saved values, re-padded into its own padded storage
    (``reset_sharded_param``, P9); the values are restored, and one more training step of the loaded
    model matches the oracle's (P6, P8, P9)."""
    from torch.distributed.tensor import DTensor, Shard

    what = "after load_state_dict(assign=True)"
    before = dict(fresh.named_parameters())
    result = fresh.load_state_dict(sd, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {what}: {result}"
    dims = placement_dims(example, oracle)
    for fqn, param in fresh.named_parameters():
        name = ctx.impl.clean_fqn(fqn)
        assert param is not before[fqn], f"{ctx.where()} {what}: {name} is the old Parameter"
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {what}: {name} is a {type(param).__name__}, expected a DTensor"
        )
        assert tuple(param.placements) == (Shard(dims[name]),), (
            f"{ctx.where()} {what}: {name} placements {param.placements}, expected "
            f"(Shard({dims[name]}),)"
        )
    params = {n: expected[n] for n, _ in oracle.named_parameters()}
    assert_per_param_layout(ctx, fresh, params, example, what, views_padded=True)
    assert_restored(ctx, fresh, expected, what)
    with torch.no_grad():  # non-persistent buffers are in no state dict: the oracle's, to train on
        for name, buf in oracle.named_buffers():
            if name not in expected:
                fresh.get_buffer(name).copy_(buf)
    start = oracle_params(oracle)
    train(ctx, fresh, oracle, example, 1)
    assert_trained(ctx, example, fresh, oracle, start, 1)
