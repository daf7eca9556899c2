"""All-gather path: the floors, FSDP2-style unshard (in pieces and end to end), FSDP1 summon.

Vocabulary (as in the reference's ``[Note: all-gather layout]``): each rank's *all-gather input*
is its padded shards of every parameter back to back (``ceil(dim0 / ws) * prod(dims[1:])``
elements per parameter); the *all-gather output* is ``ws`` such rows; *copy-in* fills this rank's
row, *copy-out* splits the rows into the unsharded parameters.

Floors measured in the same task, interleaved with the path:
* ``floor`` — one ``all_gather_into_tensor`` of exactly the padded bytes the path gathers;
* ``naive`` — a per-parameter ``all_gather`` into a list plus ``cat`` (what FSDP improves on).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from perf._bodies.shapes import Bag, dim0_padded_numel, original, payload, shapes
from perf._bodies.timing import Step, measure


def padded_chunk(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of ``full``, zero-padded to ``ceil(dim0 / ws)`` rows."""
    rows = math.ceil(full.shape[0] / world_size)
    out = full.new_zeros((rows, *full.shape[1:]))
    piece = full[rank * rows : (rank + 1) * rows]
    out[: piece.shape[0]].copy_(piece)
    return out


def originals(ctx, shape_set, size_mb):
    shape_list = shapes(shape_set, size_mb)
    return shape_list, [original(i, s).to(ctx.device) for i, s in enumerate(shape_list)]


# torch 2.13 deprecates the name all_gather_into_tensor in favour of all_gather_single (same op)
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_floor(ctx, numel: int) -> tuple[Step, torch.Tensor, torch.Tensor]:
    """One raw single-tensor all-gather of ``numel`` fp32 elements per rank (the floor)."""
    inp = torch.empty(numel, dtype=torch.float32, device=ctx.device)
    out = torch.empty(numel * ctx.world_size, dtype=torch.float32, device=ctx.device)
    return Step(lambda _: _gather_single(out, inp)), inp, out


def floors(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """``floor`` and ``naive`` for one shape set; checks both gather the originals."""
    ws, rank = ctx.world_size, ctx.rank
    shape_list, origs = originals(ctx, shape_set, size_mb)
    chunks = [padded_chunk(t, rank, ws) for t in origs]
    numel = sum(c.numel() for c in chunks)
    floor, inp, out = gather_floor(ctx, numel)
    torch.cat([c.reshape(-1) for c in chunks], out=inp)

    def naive(_):
        fulls = []
        for t, c in zip(origs, chunks):
            parts = [torch.empty_like(c) for _ in range(ws)]
            dist.all_gather(parts, c)
            fulls.append(torch.cat(parts)[: t.shape[0]])
        return fulls

    # correctness once: the floor's output rows are every rank's padded chunks; naive = originals
    floor.run(None)
    rows = out.view(ws, numel)
    for r in range(ws):
        expect = torch.cat([padded_chunk(t, r, ws).reshape(-1) for t in origs])
        assert torch.equal(rows[r], expect), (
            f"{ctx.where()} floor row {r} != rank {r}'s padded chunks"
        )
    for i, (got, t) in enumerate(zip(naive(None), origs)):
        assert torch.equal(got, t), f"{ctx.where()} naive all_gather+cat of p{i} != original"
    times = measure(ctx, {"floor": floor, "naive": Step(naive)}, quick=quick, **timing)
    return {"times": times, "info": {**payload(shape_list, ws), "gather_bytes": numel * ws * 4}}


# ------------------------------------------------------------------------------------ FSDP2-style
def param_group(module):
    """The FSDPParamGroup of a module that ``fully_shard`` was applied to (torch / reference)."""
    state = module._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None)
    if group is None:
        groups = getattr(state, "_fsdp_param_groups", None) or []
        group = groups[0] if groups else None
    if group is None:
        raise AssertionError("no FSDPParamGroup found on the fully_shard module")
    return group


def fsdp2(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """Pieces and end-to-end unshard+reshard of one ``fully_shard`` group, with the floor."""
    ctx.require("fsdp2-api")
    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    model = Bag(shape_list, ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    # correctness once (this also runs lazy init): the unsharded parameters equal the originals
    model.unshard()
    for i, t in enumerate(origs):
        got = getattr(model, f"p{i}")
        assert tuple(got.shape) == tuple(t.shape) and torch.equal(got.detach(), t), (
            f"{ctx.where()} unsharded p{i} (shape {tuple(got.shape)}) != original {tuple(t.shape)}"
        )
    model.reshard()
    group = param_group(model)
    fsdp_params = list(group.fsdp_params)
    rule_numel = sum(dim0_padded_numel(s, ws) for s in shape_list)
    impl_numel = sum(t.numel() for fp in fsdp_params for t in fp.all_gather_inputs)
    floor, _, _ = gather_floor(ctx, rule_numel)
    row_out = torch.empty(impl_numel * ws, dtype=torch.float32, device=ctx.device)
    row = row_out.narrow(0, impl_numel * ctx.rank, impl_numel)

    def copy_in(_):  # FSDPParam.all_gather_inputs + one foreach copy into this rank's row
        inputs = [t for fp in fsdp_params for t in fp.all_gather_inputs]
        with torch.no_grad():
            torch._foreach_copy_(list(torch.split(row, [t.numel() for t in inputs])), inputs)

    def e2e(_):
        model.unshard()
        model.reshard()

    def finish(_):
        group.wait_for_unshard()
        model.reshard()

    steps = {
        "floor": floor,
        "e2e": Step(e2e),
        "copy_in": Step(copy_in),
        "unshard": Step(lambda _: group.unshard(False), after=finish),  # copy-in + collective
        "copy_out": Step(
            lambda _: group.wait_for_unshard(),
            prepare=lambda: group.unshard(False),
            after=lambda _: model.reshard(),
        ),
    }
    times = measure(ctx, steps, quick=quick, **timing)
    return {
        "times": times,
        "info": {
            **payload(shape_list, ws),
            "gather_bytes": rule_numel * ws * 4,
            "impl_gather_bytes": impl_numel * ws * 4,
        },
    }


# ------------------------------------------------------------------------------------ FSDP1-style
def flat_padded_numel(numels: list[int], world_size: int) -> int:
    """Per-rank numel of a flat parameter: ``ceil(sum(numels) / ws)``."""
    return math.ceil(sum(numels) / world_size)


def fsdp1(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """``summon_full_params(writeback=False)`` of one flat parameter, with the floor."""
    ctx.require("fsdp1-api")
    ws = ctx.world_size
    shape_list, origs = originals(ctx, shape_set, size_mb)
    model = ctx.impl.shard(Bag(shape_list, ctx.device), ctx)
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    with FSDP.summon_full_params(model, writeback=False):
        got = {ctx.impl.clean_fqn(n): p.detach() for n, p in model.named_parameters()}
        for i, t in enumerate(origs):
            g = got.get(f"p{i}")
            assert g is not None and torch.equal(g.reshape(t.shape), t), (
                f"{ctx.where()} summoned p{i} != original (names seen: {sorted(got)[:4]}...)"
            )
    numel = flat_padded_numel([math.prod(s) for s in shape_list], ws)
    floor, _, _ = gather_floor(ctx, numel)

    def e2e(_):
        with FSDP.summon_full_params(model, writeback=False):
            pass

    times = measure(ctx, {"floor": floor, "e2e": Step(e2e)}, quick=quick, **timing)
    info = payload(shape_list, ws)
    info.update(
        padded_bytes=numel * ws * 4,
        payload_efficiency=info["unpadded_bytes"] / (numel * ws * 4),
        gather_bytes=numel * ws * 4,
    )
    return {"times": times, "info": info}
