"""State-dict paths, save and load, with the raw gather as the floor of FULL.

FSDP1-style kinds (``FullyShardedDataParallel.state_dict_type``): ``full``, ``full_rank0``
(``rank0_only=True``), ``full_rank0_offload`` (``rank0_only`` + ``offload_to_cpu``; on a CPU compute
device upstream torch 2.13 is broken, pytorch#188989, so it is not run there), ``sharded``, ``local``.
FSDP2-style kinds: ``dtensor`` (``module.state_dict()`` / ``load_state_dict``), and the DCP helpers
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict``:
``dcp_full`` (``full_state_dict=True``), ``dcp_full_rank0_offload`` (``+ cpu_offload=True``; loaded
back with ``broadcast_from_rank0=True``) and ``dcp_sharded`` (default options).

Floor of every FULL kind: one all-gather of the padded bytes the path gathers (plus one copy of the
gathered bytes into CPU memory when the kind offloads). SHARDED/LOCAL/DTensor kinds have no floor:
on a per-parameter layout they should not copy at all, so their cost per parameter is reported and
must stay flat as the bytes grow.

Correctness, once per configuration: the saved dict has the unwrapped model's keys and values
(full tensors compared directly; DTensors through ``full_tensor()``; ShardedTensors shard by shard
against the rule's rows ``[rank * ceil(dim0 / ws), ...)``; a LOCAL flat shard against the
concatenated originals); and a second, zero-initialised sharded model equals the originals after
loading the dict.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from perf._bodies.allgather import flat_padded_numel, gather_floor, originals, padded_chunk
from perf._bodies.shapes import Bag, dim0_padded_numel, payload
from perf._bodies.timing import Step, measure

FSDP1_KINDS = ("full", "full_rank0", "full_rank0_offload", "sharded", "local")
FSDP2_KINDS = ("dtensor", "dcp_full", "dcp_full_rank0_offload", "dcp_sharded")
BROKEN_CPU_OFFLOAD = (
    "FSDP1 FULL offload_to_cpu on a CPU compute device is broken upstream "
    "(pytorch#188989: setStorage ... storage of size 0)"
)


def _zero_bag(shape_list, device) -> Bag:
    bag = Bag(shape_list, device)
    with torch.no_grad():
        for p in bag.parameters():
            p.zero_()
    return bag


def check_state_dict(ctx, sd: dict, origs, what: str, *, expect_empty: bool = False) -> None:
    """``sd`` holds the unwrapped model's keys and values (see the module docstring)."""
    where = f"{ctx.where()} {what}"
    if expect_empty:
        assert not sd, f"{where}: expected an empty dict on rank {ctx.rank}, got {sorted(sd)[:4]}"
        return
    ws = ctx.world_size
    keys = sorted(ctx.impl.clean_fqn(k) for k in sd)
    if keys == ["_flat_param"]:  # LOCAL: this rank's unpadded piece of the flat parameter
        (value,) = sd.values()
        flat = torch.cat([t.reshape(-1) for t in origs])
        for shard in value.local_shards():
            (off,) = shard.metadata.shard_offsets
            n = shard.tensor.numel()
            assert torch.equal(shard.tensor.reshape(-1).to(flat.device), flat[off : off + n]), (
                f"{where}: LOCAL shard at offset {off} != the concatenated originals there"
            )
        return
    expected_keys = sorted(f"p{i}" for i in range(len(origs)))
    assert keys == expected_keys, (
        f"{where}: keys {keys[:5]}... != unwrapped model's {expected_keys[:5]}..."
    )
    for key in sorted(sd):
        t = origs[int(ctx.impl.clean_fqn(key)[1:])]
        value = sd[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif hasattr(value, "local_shards"):  # ShardedTensor: check this rank's rows
            rows = math.ceil(t.shape[0] / ws)
            for shard in value.local_shards():
                off = shard.metadata.shard_offsets[0]
                assert off == ctx.rank * rows, (
                    f"{where}: {key} shard offset {off} != {ctx.rank * rows}"
                )
                expect = padded_chunk(t, ctx.rank, ws)[: shard.tensor.shape[0]]
                assert torch.equal(shard.tensor.to(t.device), expect), (
                    f"{where}: {key} shard != rows"
                )
            continue
        assert tuple(value.shape) == tuple(t.shape) and torch.equal(value.to(t.device), t), (
            f"{where}: {key} (shape {tuple(value.shape)}) != original {tuple(t.shape)}"
        )


# ------------------------------------------------------------------------------------ FSDP1-style
_FSDP1_CONFIG = {
    "full": ("full", {}),
    "full_rank0": ("full", {"rank0_only": True}),
    "full_rank0_offload": ("full", {"rank0_only": True, "offload_to_cpu": True}),
    "sharded": ("sharded", {}),
    "local": ("local", {}),
}


def fsdp1(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """Every FSDP1 kind on one sharded model (and one zero-initialised load target); steps
    ``<kind>/floor``, ``<kind>/save``, ``<kind>/load`` interleaved in one task."""
    ctx.require("fsdp1-api")
    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    impl = ctx.impl
    model = impl.shard(Bag(shape_list, ctx.device), ctx)
    target = impl.shard(_zero_bag(shape_list, ctx.device), ctx)
    numel = flat_padded_numel([math.prod(s) for s in shape_list], ws)
    steps, skipped = {}, {}
    for kind in FSDP1_KINDS:
        base, config = _FSDP1_CONFIG[kind]
        if config.get("offload_to_cpu") and ctx.device.type == "cpu":
            skipped[kind] = BROKEN_CPU_OFFLOAD
            continue
        sd = impl.state_dict(model, base, **config)
        check_state_dict(
            ctx,
            sd,
            origs,
            f"FSDP1 {kind} state_dict",
            expect_empty=bool(config.get("rank0_only")) and ctx.rank != 0 and ws > 1,
        )
        if base == "full":
            steps[f"{kind}/floor"] = _full_floor(
                ctx, numel, offload=bool(config.get("offload_to_cpu"))
            )
        steps[f"{kind}/save"] = Step(lambda _, b=base, c=config: impl.state_dict(model, b, **c))
        if not config:  # a rank0_only dict loads like a broadcast FULL one: not measured separately
            impl.load_state_dict(target, dict(sd), base)
            check_state_dict(
                ctx, impl.state_dict(target, "full"), origs, f"FSDP1 after {kind} load"
            )
            _zero_fsdp1(impl, target)
            steps[f"{kind}/load"] = Step(
                lambda d, b=base: impl.load_state_dict(target, d, b), prepare=lambda sd=sd: dict(sd)
            )
    times = measure(ctx, steps, quick=quick, **timing)
    info = payload(shape_list, ws)
    info.update(
        gather_bytes=numel * ws * 4,
        padded_bytes=numel * ws * 4,
        payload_efficiency=info["unpadded_bytes"] / (numel * ws * 4),
        skipped=skipped,
    )
    return {"times": times, "info": info}


def _zero_fsdp1(impl, module) -> None:
    """Zero the sharded flat parameters, so the next kind's load check starts from zeros."""
    with torch.no_grad():
        for _, shard in impl.flat_shards(module):
            shard.zero_()


def _full_floor(ctx, numel: int, offload: bool) -> Step:
    floor, _, out = gather_floor(ctx, numel)
    if not offload:
        return floor
    host = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    return Step(lambda _: (floor.run(None), host.copy_(out)))


# ------------------------------------------------------------------------------------ FSDP2-style
def fsdp2(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """Every FSDP2 kind on one sharded model (and one zero-initialised load target)."""
    ctx.require("fsdp2-api")
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    fully_shard = ctx.impl.ns.fully_shard
    model = fully_shard(Bag(shape_list, ctx.device), mesh=ctx.mesh)
    target = fully_shard(_zero_bag(shape_list, ctx.device), mesh=ctx.mesh)
    numel = sum(dim0_padded_numel(s, ws) for s in shape_list)
    steps = {}
    for kind in FSDP2_KINDS:
        full = kind.startswith("dcp_full")
        offload = kind.endswith("offload")
        if kind == "dtensor":
            save = lambda _: model.state_dict()  # noqa: E731
            load = lambda d: target.load_state_dict(d)  # noqa: E731
        else:
            opts = StateDictOptions(full_state_dict=full, cpu_offload=offload)
            load_opts = StateDictOptions(full_state_dict=full, broadcast_from_rank0=offload)
            save = lambda _, o=opts: get_model_state_dict(model, options=o)  # noqa: E731
            load = lambda d, o=load_opts: set_model_state_dict(target, d, options=o)  # noqa: E731
        sd = save(None)
        rank0_only = offload and ctx.rank != 0 and ws > 1
        check_state_dict(ctx, sd, origs, f"FSDP2 {kind} state dict", expect_empty=rank0_only)
        if offload and not rank0_only:
            assert all(v.device.type == "cpu" for v in sd.values()), (
                f"{ctx.where()} {kind}: offloaded dict not on CPU"
            )
        load(dict(sd))
        target.unshard()
        for i, t in enumerate(origs):
            assert torch.equal(getattr(target, f"p{i}").detach(), t), (
                f"{ctx.where()} FSDP2 after {kind} load: p{i} != original"
            )
        target.reshard()
        with torch.no_grad():  # zero again so the next kind's load check starts from zeros
            for p in target.parameters():
                p.to_local().zero_()
        if full:
            steps[f"{kind}/floor"] = _full_floor(ctx, numel, offload=offload)
        steps[f"{kind}/save"] = Step(save)
        steps[f"{kind}/load"] = Step(load, prepare=lambda sd=sd: dict(sd))
    times = measure(ctx, steps, quick=quick, **timing)
    return {
        "times": times,
        "info": {**payload(shape_list, ws), "gather_bytes": numel * ws * 4, "skipped": {}},
    }
