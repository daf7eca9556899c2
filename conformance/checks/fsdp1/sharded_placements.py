"""Area "state_dict": the shard placements of FSDP1's SHARDED_STATE_DICT ShardedTensors (R106).

The oracle is the rule: chunk r of a parameter's dim-0 chunks is placed on global rank r, on
``cpu`` for a CPU run, else on ``<type>:<r mod the node's device count>``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.SHARDED_STATE_DICT}


def _device_str(ctx, rank: int) -> str:
    if ctx.device.type == "cpu":
        return "cpu"
    count = torch.get_device_module(ctx.device.type).device_count()
    return f"{ctx.device.type}:{rank % count}"


# ------------------------------------------------------------------------------ R106
@check(area="state_dict", requires=REQUIRES, world_sizes=(2,))
def fsdp1_sharded_state_dict_placements(ctx):
    """R106: under SHARDED_STATE_DICT at ws 2, one unit over ``Sequential(Linear(4, 4), Linear(4, 1))``
    (``use_orig_params`` True and False): every value is a ShardedTensor whose shards metadata
    lists one placement per dim-0 chunk of the parameter (``torch.chunk(p, ws, 0)``), chunk r's
    ``rank:r/cpu`` on a CPU run (no device index), ``rank:r/<type>:<r mod device count>`` on an
    accelerator."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    for use_orig_params in (False, True):
        ctx.seed(0)
        plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).to(ctx.device)
        shapes = {n: p.shape for n, p in plain.named_parameters()}
        model = fsdp(plain, use_orig_params=use_orig_params, **_kwargs(ctx))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fsdp.set_state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT)
            sd = model.state_dict()
        what = f"use_orig_params={use_orig_params} SHARDED state_dict"
        assert sorted(sd) == sorted(shapes), (
            f"{ctx.where()} {what} keys {sorted(sd)}, expected {sorted(shapes)}"
        )
        for name, shape in shapes.items():
            value = sd[name]
            assert isinstance(value, ShardedTensor), (
                f"{ctx.where()} {what}[{name!r}] is {type(value).__name__}, not ShardedTensor"
            )
            chunks = len(torch.empty(shape).chunk(ctx.world_size, 0))
            want = [f"rank:{r}/{_device_str(ctx, r)}" for r in range(chunks)]
            got = [str(md.placement) for md in value.metadata().shards_metadata]
            assert got == want, f"{ctx.where()} {what}[{name!r}] placements {got}, expected {want}"
