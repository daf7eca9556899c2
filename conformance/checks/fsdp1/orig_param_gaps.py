"""Area "fsdp1_runtime": tied parameters in ``no_sync``, deregistered parameters, first local dict
(R79-R81, R110).

[Note: original parameters at the edges of a unit's life]
* With ``use_orig_params=True`` a parameter shared by two modules of one unit (``m[1].weight =
  m[0].weight``) gets, inside ``no_sync()``, the same gradient as every other original parameter
  there: the unsharded one, of the parameter's full shape, equal to the unsharded model's gradient
  on the rank's own samples; a later synced backward then reduces the accumulated gradient, and an
  optimizer step gives the unsharded model's parameters (R79).
* ``summon_full_params`` first writes back what the user changed, as a forward does (R64): an
  original parameter whose ``.data`` was replaced (same shape) shows its new values inside it.
  One deregistered from its module (``del inner[0].weight``, as checkpointing wrappers do for a
  while) is skipped, and the writeback goes on with the parameters after it (R80).
* A ``LOCAL_STATE_DICT`` taken as the very first use of a unit whose original parameters were all
  frozen after wrapping holds a flat shard that does not require grad (the flat parameter follows
  its original parameters, R75, from the state dict on, not only from the next forward), with S7's
  values: elements ``[r*ceil(N/ws), ...)`` of the parameters flattened in registration order
  (R81).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.checks.fsdp1.flat_param_gaps import _kwargs
from conformance.checks.fsdp1.training import (
    BF16_TOLS,
    assert_orig_param_grads,
    assert_params_equal_oracle,
)
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _global_batch(ctx, salt: int) -> torch.Tensor:
    """``ws * B`` samples, the same on every rank; rank r feeds ``r*B .. (r+1)*B``."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum(dim=1).mean()


# ------------------------------------------------------------------------------ R79
def _tied() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight
    return m


def _assert_no_sync_grads(ctx, inner, local, what, tol) -> None:
    """Inside ``no_sync()`` every original parameter of the tied model (by either name of the
    tied one) has a gradient of its full shape equal to ``local``'s (compared in fp32)."""
    for name in ("0.weight", "1.weight", "0.bias", "1.bias"):
        grad = inner.get_parameter(name).grad
        want = local.get_parameter(name).grad
        assert grad is not None, f"{ctx.where()} {what}: {name} has no gradient"
        assert tuple(grad.shape) == tuple(want.shape), (
            f"{ctx.where()} {what}: {name}.grad has shape {tuple(grad.shape)}, expected the "
            f"unsharded {tuple(want.shape)}"
        )
        assert_close(ctx, f"{what} gradient of {name} (rank's samples)", grad.float(), want, tol)


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_NO_SYNC_ORIG_GRADS},
    world_sizes=(2,),
)
def tied_param_no_sync_grad(ctx):
    """R79: ``use_orig_params=True``, FULL_SHARD, one unit over ``Sequential(Linear(4, 4),
    Linear(4, 4))`` with ``m[1].weight = m[0].weight``: a forward and backward inside
    ``no_sync()`` on rank r's samples gives ``m[0].weight`` (and ``m[1].weight``, the same
    parameter) a gradient of shape (4, 4) equal to the unsharded model's gradient on those
    samples, and each bias its unsharded gradient likewise; a following synced backward on a
    second batch gives every parameter the chunk of the unsharded model's gradient summed over
    both batches (mean over all ranks' samples), and an SGD step the unsharded model's parameters."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = ns.FullyShardedDataParallel(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    inner = model.module
    x, y = _global_batch(ctx, 41), _global_batch(ctx, 42)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)

    with model.no_sync():
        _loss(model(x[mine])).backward()
    local = copy.deepcopy(oracle)
    _loss(local(x[mine])).backward()
    _assert_no_sync_grads(ctx, inner, local, "no_sync()", FP32["grad"])

    _loss(model(y[mine])).backward()
    (_loss(oracle(x)) + _loss(oracle(y))).backward()
    assert_orig_param_grads(ctx, model, oracle, "synced backward after no_sync()")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    opt.step()
    oopt.step()
    assert_params_equal_oracle(ctx, model, oracle, "after the SGD step")


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_NO_SYNC_ORIG_GRADS, base.MIXED_PRECISION},
    world_sizes=(1, 2),
)
def tied_param_no_sync_grad_bf16(ctx):
    """R110: ``tied_param_no_sync_grad``'s tied model with ``use_orig_params=True``, ``sharding_strategy=NO_SHARD`` and
    ``MixedPrecision(param_dtype=torch.bfloat16)``: a forward and backward inside ``no_sync()``
    on rank r's samples completes and gives the tied parameter (by either name) and each bias a
    gradient of its full shape equal to the unsharded fp32 model's gradient on those samples
    within bf16 tolerance."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = ns.FullyShardedDataParallel(
        copy.deepcopy(oracle),
        use_orig_params=True,
        sharding_strategy=ns.ShardingStrategy.NO_SHARD,
        mixed_precision=ns.MixedPrecision(param_dtype=torch.bfloat16),
        **_kwargs(ctx),
    )
    inner = model.module
    x = _global_batch(ctx, 43)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    with model.no_sync():
        _loss(model(x[mine]).float()).backward()
    _loss(oracle(x[mine])).backward()
    _assert_no_sync_grads(ctx, inner, oracle, "bf16 no_sync()", BF16_TOLS["grad"])


# ------------------------------------------------------------------------------ R80
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def writeback_past_deregistered_param(ctx):
    """R80: ``use_orig_params=True``, one unit over ``Sequential(Linear(4, 2), Linear(2, 8))``
    (sized so that at world size 2, in upstream's layout, rank 0's shard holds ``0.weight`` and the
    start of ``1.weight``):
    ``del inner[0].weight`` (deregistered), then ``inner[1].weight.data`` and
    ``inner[1].bias.data`` replaced by tensors of their (sharded) shapes holding 2.0 and -1.0;
    inside ``summon_full_params`` every rank sees ``1.weight`` all 2.0 and ``1.bias`` all -1.0,
    and ``0.bias`` unchanged."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 8)).to(ctx.device)
    model = ns.FullyShardedDataParallel(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    inner = model.module
    del inner[0].weight
    with torch.no_grad():
        inner[1].weight.data = torch.full_like(inner[1].weight, 2.0)
        inner[1].bias.data = torch.full_like(inner[1].bias, -1.0)
        oracle[1].weight.fill_(2.0)
        oracle[1].bias.fill_(-1.0)
    with ns.FullyShardedDataParallel.summon_full_params(model):
        for name in ("1.weight", "1.bias", "0.bias"):
            want = oracle.get_parameter(name)
            got = getattr(inner[int(name[0])], name[2:])
            assert tuple(got.shape) == tuple(want.shape), (
                f"{ctx.where()} summon_full_params: {name} of shape {tuple(got.shape)}, "
                f"expected {tuple(want.shape)}"
            )
            assert_close(
                ctx,
                f"{name} in summon_full_params after del 0.weight and a .data replacement",
                got.detach(),
                want.detach(),
                FP32["param"],
            )


# ------------------------------------------------------------------------------ R81
@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.LOCAL_STATE_DICT, base.FSDP1_LOCAL_ORIG_PARAMS},
    world_sizes=(2,),
)
def local_state_dict_first_frozen(ctx):
    """R81: ``use_orig_params=True``, one unit over ``Sequential(Linear(4, 4), Linear(4, 4))``,
    every original parameter frozen after wrapping; a LOCAL state dict as the unit's first use:
    ``_flat_param``'s local shard does not require grad and equals elements
    ``[r*ceil(N/ws), min((r+1)*ceil(N/ws), N))`` of the parameters flattened in registration
    order (N = 40)."""
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(plain), ctx, use_orig_params=True)
    for p in model.parameters():
        p.requires_grad_(False)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "local"))
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in plain.parameters()])
    start, end, _ = flat_range(flat.numel(), ctx.world_size, ctx.rank)
    entry = sd.get("_flat_param")
    assert entry is not None and hasattr(entry, "local_shards"), (
        f"{ctx.where()} _flat_param: {type(entry).__name__}, expected a ShardedTensor "
        f"(keys {sorted(sd)})"
    )
    shards = entry.local_shards()
    assert len(shards) == (1 if end > start else 0), (
        f"{ctx.where()} _flat_param: {len(shards)} local shard(s) for elements {start}:{end}"
    )
    for shard in shards:
        local = shard.tensor
        assert not local.requires_grad, (
            f"{ctx.where()} every parameter frozen before the first state_dict(), yet the local "
            "flat shard requires grad"
        )
        assert torch.equal(local.detach().cpu(), flat[start:end]), (
            f"{ctx.where()} _flat_param local shard {local.detach().cpu().tolist()[:6]}..., "
            f"expected elements {start}:{end} of the flattened parameters"
        )
