"""Area "state_dict": ``offload_to_cpu`` of FSDP1's SHARDED and LOCAL state dicts (S5, S7).

[Note: offload moves, never changes]
``offload_to_cpu`` changes where SHARDED / LOCAL values live, never what they hold (same types,
shard metadata and values as without it).
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.sd_models import AREA, build, first_error_everywhere, require_kind
from conformance.checks.state_dict.fsdp1 import _local_tensors
from conformance.registry import check


def _metadata(value):
    if hasattr(value, "local_shards"):
        return (
            "ShardedTensor",
            tuple(value.metadata().size),
            [tuple(s.metadata.shard_offsets) for s in value.local_shards()],
        )
    return (type(value).__name__, tuple(value.shape), [])


OFFLOAD_CASES = {k: {"kind": k} for k in ("sharded", "local")}


@check(area=AREA, requires={base.FLAT_PARAM}, cases=OFFLOAD_CASES, min_world_size=2)
def offload_to_cpu_values(ctx, kind):
    """S5/S7: with ``offload_to_cpu=True`` the SHARDED / LOCAL dict has the same keys, types, shard
    sizes and offsets, and values as without it."""
    require_kind(ctx, kind)
    model = build(ctx)
    plain = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    off = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind, offload_to_cpu=True))
    assert set(off) == set(plain), f"{ctx.where()} offload keys {sorted(off)} != {sorted(plain)}"
    for name in sorted(plain):
        assert _metadata(off[name]) == _metadata(plain[name]), (
            f"{ctx.where()} {name}: with offload {_metadata(off[name])}, without {_metadata(plain[name])}"
        )
        for a, b in zip(_local_tensors(off[name]), _local_tensors(plain[name])):
            assert torch.equal(a.cpu(), b.cpu()), f"{ctx.where()} {name}: offloaded values differ"


@check(area=AREA, requires={base.FLAT_PARAM}, cases=OFFLOAD_CASES, min_world_size=2)
def offload_to_cpu_device(ctx, kind):
    """S5/S7: with ``offload_to_cpu=True`` every local shard of a SHARDED / LOCAL dict is on the
    CPU (needs an accelerator: on a CPU run every tensor is on the CPU anyway)."""
    require_kind(ctx, kind)
    if ctx.device.type == "cpu":
        raise NotSupported(
            "an accelerator: on CPU, offloaded and resident tensors are both on the CPU"
        )
    sd = first_error_everywhere(
        ctx, lambda: ctx.impl.state_dict(build(ctx), kind, offload_to_cpu=True)
    )
    for name, value in sd.items():
        if not hasattr(value, "local_shards"):
            continue  # buffers are not offloaded
        for t in _local_tensors(value):
            assert t.device.type == "cpu", f"{ctx.where()} {name}: offloaded shard on {t.device}"
