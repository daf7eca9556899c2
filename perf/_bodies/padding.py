"""Padding path: sharding with padding at construction, and re-padding after a replacement.

* ``construct`` — ``fully_shard(module)`` (FSDP2-style: each parameter's dim-0 chunk copied into a
  zero-padded ``ceil(dim0 / ws)``-row buffer) or ``FullyShardedDataParallel(module)`` (FSDP1-style:
  all parameters flattened into one buffer padded to a multiple of ``ws``); a fresh module per round
  (built untimed).
* ``load_assign`` — ``module.load_state_dict(sd, assign=True)`` with fresh unpadded DTensors: the
  post-load hook runs ``FSDPParam.reset_sharded_param``, which re-pads each local tensor (spec P9).
* ``reset`` — ``reset_sharded_param()`` on every FSDPParam after the parameters were replaced by
  fresh DTensors (untimed), i.e. the re-pad alone without ``load_state_dict``'s bookkeeping.

Floor: ``memcpy`` — one ``copy_`` of the same number of bytes the path writes (this rank's padded
shard bytes). GB/s are those bytes over the time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from perf._bodies.allgather import flat_padded_numel, originals, padded_chunk, param_group
from perf._bodies.shapes import Bag, dim0_padded_numel, payload
from perf._bodies.timing import Step, measure


def memcpy_floor(ctx, numel: int) -> Step:
    src = torch.ones(numel, dtype=torch.float32, device=ctx.device)
    dst = torch.empty_like(src)
    return Step(lambda _: dst.copy_(src))


def _check_fsdp2_shards(ctx, model, origs, what: str, offset: float = 0.0) -> None:
    """Every local shard is the rule's dim-0 chunk, and its padded storage pads with zeros."""
    ws = ctx.world_size
    group = param_group(model)
    for i, (fp, t) in enumerate(zip(group.fsdp_params, origs)):
        expect = padded_chunk(t + offset, ctx.rank, ws)
        padded = fp._sharded_param_data.view(expect.shape)
        assert torch.equal(padded, expect), (
            f"{ctx.where()} {what}: padded shard of p{i} != rows of chunk {ctx.rank} of "
            f"ceil({t.shape[0]}/{ws}) rows, zero-padded"
        )
        local = getattr(model, f"p{i}").to_local()
        rows = min(max(t.shape[0] - ctx.rank * expect.shape[0], 0), expect.shape[0])
        assert local.shape[0] == rows and torch.equal(local, expect[:rows]), (
            f"{ctx.where()} {what}: local tensor of p{i} has {local.shape[0]} rows, expected {rows}"
        )


def fsdp2(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    ctx.require("fsdp2-api")
    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    fully_shard = ctx.impl.ns.fully_shard
    numel = sum(dim0_padded_numel(s, ws) for s in shape_list)

    model = fully_shard(Bag(shape_list, ctx.device), mesh=ctx.mesh)
    _check_fsdp2_shards(ctx, model, origs, "after fully_shard")
    group = param_group(model)

    def fresh_dtensors(offset: float = 0.0) -> dict:
        return {
            k: (v.detach() + offset) if offset else v.detach().clone()
            for k, v in model.state_dict().items()
        }

    # correctness once: loading (assign=True) shifted values re-pads them; then back to originals
    model.load_state_dict(fresh_dtensors(1.0), assign=True)
    _check_fsdp2_shards(ctx, model, origs, "after load_state_dict(assign=True)", offset=1.0)
    model.load_state_dict(fresh_dtensors(-1.0), assign=True)

    def replace_params():
        for k, v in fresh_dtensors().items():
            setattr(model, k, nn.Parameter(v))

    def reset(_):
        for fp in group.fsdp_params:
            fp.reset_sharded_param()

    replace_params()
    reset(None)
    _check_fsdp2_shards(ctx, model, origs, "after reset_sharded_param")
    steps = {
        "memcpy": memcpy_floor(ctx, numel),
        "construct": Step(
            lambda m: fully_shard(m, mesh=ctx.mesh), prepare=lambda: Bag(shape_list, ctx.device)
        ),
        "load_assign": Step(
            lambda sd: model.load_state_dict(sd, assign=True), prepare=fresh_dtensors
        ),
        "reset": Step(reset, prepare=replace_params),
    }
    times = measure(ctx, steps, quick=quick, **timing)
    return {"times": times, "info": {**payload(shape_list, ws), "local_padded_bytes": numel * 4}}


def fsdp1(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    ctx.require("fsdp1-api")
    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    numel = (
        flat_padded_numel([math.prod(s) for s in shape_list], ws)
        if ws > 1
        else sum(math.prod(s) for s in shape_list)
    )
    model = ctx.impl.shard(Bag(shape_list, ctx.device), ctx)
    ((fqns, shard),) = ctx.impl.flat_shards(model)
    flat = torch.cat([t.reshape(-1) for t in origs])
    expect = flat.new_zeros(numel * ws)
    expect[: flat.numel()] = flat
    expect = expect.view(ws, numel)[ctx.rank]
    assert shard.numel() == numel and torch.equal(shard, expect), (
        f"{ctx.where()} flat shard ({shard.numel()} elements) != chunk {ctx.rank} of the "
        f"concatenated originals padded to {numel * ws} elements"
    )
    steps = {
        "memcpy": memcpy_floor(ctx, numel),
        "construct": Step(
            lambda m: ctx.impl.shard(m, ctx), prepare=lambda: Bag(shape_list, ctx.device)
        ),
    }
    times = measure(ctx, steps, quick=quick, **timing)
    info = payload(shape_list, ws)
    info.update(
        local_padded_bytes=numel * 4,
        padded_bytes=numel * ws * 4,
        payload_efficiency=info["unpadded_bytes"] / (numel * ws * 4),
    )
    return {"times": times, "info": info}
