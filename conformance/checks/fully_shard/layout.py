"""Area "layout": where each element of each parameter lives after sharding.

[Note: the two layouts]
per-parameter dim-0 (FSDP2): each parameter is split on dim 0 like ``torch.chunk(p, ws, 0)``:
    chunk = ceil(dim0 / ws) rows; rank r holds rows [r*chunk, min((r+1)*chunk, dim0)), possibly none.
    Its local storage is a 1-D buffer of ``chunk * prod(dims[1:])`` elements (the padded size), the
    rows first and zeros after. The registered parameter is a DTensor with the original global size
    and stride and placement ``Shard(0)``.
flat parameter (FSDP1): the parameters of one wrapped module, flattened in registration order, are
    concatenated into N elements; chunk = ceil(N / ws); rank r holds elements
    [r*chunk, min((r+1)*chunk, N)) followed by zeros up to ``chunk`` elements.
Every expectation below is computed from these rules, never read from the implementation.
"""

from __future__ import annotations

import math

import torch

from conformance.adapters import base
from conformance.checks._shared.models import ParamBag
from conformance.checks._shared.rows import chunk_range, chunk_size, flat_range
from conformance.registry import check

dim0_rows = chunk_range  # rows [start, end) of a dim0-long parameter that a rank holds


# dim-0 relations to the world size; each becomes a case for 1-D, 2-D and 3-D parameters
_DIM0 = {
    "lt-ws": lambda ws: ws - 1,  # smaller than the world size (0 at ws 1: a zero-size dim)
    "eq-ws": lambda ws: ws,
    "ws-plus-1": lambda ws: ws + 1,
    "uneven": lambda ws: 3 * ws + 2 if ws > 1 else 5,  # not divisible (for ws > 1)
    "one": lambda ws: 1,
}
_TRAILING = {"1d": (), "2d": (3,), "3d": (2, 3)}
SHAPE_CASES = {
    f"{rank}-dim0-{rel}": {"rel": rel, "trailing": trailing}
    for rel in _DIM0
    for rank, trailing in _TRAILING.items()
}
# zero-size parameters: a zero dim 0, and a zero trailing dim (numel 0 with rows to split)
SHAPE_CASES |= {
    "zero-dim0-2d": {"shape": (0, 4)},
    "zero-trailing-2d": {"shape": (4, 0)},
    "zero-trailing-3d": {"shape": (3, 0, 2)},
}
# several parameters of mixed shapes in one module (one all-gather group / one flat parameter)
SHAPE_CASES["mixed-group"] = {"shapes": [(5, 3), (7,), (1, 6), (2, 2, 2), (16, 4)]}


def _shapes(ctx, rel=None, trailing=(), shape=None, shapes=None) -> list[tuple[int, ...]]:
    if shapes is not None:
        return [tuple(s) for s in shapes]
    if shape is not None:
        return [tuple(shape)]
    return [(_DIM0[rel](ctx.world_size), *trailing)]


@check(area="layout", requires={base.PER_PARAM_DIM0}, cases=SHAPE_CASES)
def per_param_dim0_local_shard(ctx, **case):
    """Each rank's local shard holds exactly rows [r*ceil(d0/ws), ...) of the original parameter, and
    its view's offset is its first row (P1)."""
    shapes = _shapes(ctx, **case)
    model = ParamBag(shapes)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = ctx.impl.shard(model, ctx)
    views = ctx.impl.local_shards(model)
    assert set(views) == set(originals), (
        f"{ctx.where()} parameter names {sorted(views)} != {sorted(originals)}"
    )
    for fqn, orig in originals.items():
        start, end = dim0_rows(orig.shape[0], ctx.world_size, ctx.rank)
        local = views[fqn].local
        expected_shape = (end - start, *orig.shape[1:])
        assert tuple(local.shape) == expected_shape, (
            f"{ctx.where()} {fqn} {tuple(orig.shape)}: local shard shape {tuple(local.shape)}, "
            f"expected {expected_shape} (rows {start}:{end})"
        )
        assert torch.equal(local.cpu(), orig[start:end]), (
            f"{ctx.where()} {fqn} {tuple(orig.shape)}: local shard values differ from rows {start}:{end}"
        )
        assert views[fqn].global_shape == tuple(orig.shape), (
            f"{ctx.where()} {fqn}: global shape {views[fqn].global_shape}, expected {tuple(orig.shape)}"
        )
        if end > start:  # an empty shard has no first row, so no offset to check
            assert views[fqn].offset == start, (
                f"{ctx.where()} {fqn} {tuple(orig.shape)}: offset {views[fqn].offset}, expected "
                f"{start} (the first row this rank holds)"
            )


@check(area="layout", requires={base.PER_PARAM_DIM0, base.PADDED_STORAGE}, cases=SHAPE_CASES)
def per_param_dim0_padded_storage(ctx, **case):
    """The local storage is 1-D with ceil(d0/ws)*prod(rest) elements: the rank's rows, then zeros."""
    shapes = _shapes(ctx, **case)
    model = ParamBag(shapes)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    views = ctx.impl.local_shards(ctx.impl.shard(model, ctx))
    for fqn, orig in originals.items():
        padded = views[fqn].padded
        assert padded is not None, f"{ctx.where()} {fqn}: implementation exposes no padded storage"
        dim0 = orig.shape[0]
        chunk = chunk_size(dim0, ctx.world_size)
        row = math.prod(orig.shape[1:])
        start, end = dim0_rows(dim0, ctx.world_size, ctx.rank)
        assert padded.dim() == 1 and padded.numel() == chunk * row, (
            f"{ctx.where()} {fqn} {tuple(orig.shape)}: padded storage has shape {tuple(padded.shape)}, "
            f"expected ({chunk * row},) = ceil({dim0}/{ctx.world_size}) * {row}"
        )
        data = (end - start) * row
        assert torch.equal(padded[:data].cpu(), orig[start:end].reshape(-1)), (
            f"{ctx.where()} {fqn}: the first {data} elements of the padded storage are not rows {start}:{end}"
        )
        assert not padded[data:].any(), (
            f"{ctx.where()} {fqn}: padding elements {data}:{padded.numel()} are not all zero: "
            f"{padded[data:].tolist()[:8]}"
        )
        if views[fqn].local.numel():
            assert (
                views[fqn].local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
            ), f"{ctx.where()} {fqn}: the local shard does not alias the padded storage"


@check(area="layout", requires={base.PER_PARAM_DIM0, base.DTENSOR_PARAMS}, cases=SHAPE_CASES)
def per_param_dim0_dtensor_metadata(ctx, **case):
    """Registered parameters are DTensors with the original size and stride, Shard(0), on the mesh."""
    from torch.distributed.tensor import DTensor, Shard

    shapes = _shapes(ctx, **case)
    model = ParamBag(shapes)
    originals = {
        n: (tuple(p.shape), p.stride(), p.requires_grad) for n, p in model.named_parameters()
    }
    model.p0.requires_grad_(False)
    originals["p0"] = (*originals["p0"][:2], False)
    model = ctx.impl.shard(model, ctx)
    for fqn, param in model.named_parameters():
        shape, stride, requires_grad = originals[ctx.impl.clean_fqn(fqn)]
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {fqn}: registered as {type(param).__name__}"
        )
        assert isinstance(param, torch.nn.Parameter), f"{ctx.where()} {fqn}: not an nn.Parameter"
        assert tuple(param.shape) == shape, (
            f"{ctx.where()} {fqn}: size {tuple(param.shape)} != {shape}"
        )
        assert param.stride() == stride, f"{ctx.where()} {fqn}: stride {param.stride()} != {stride}"
        assert tuple(param.placements) == (Shard(0),), (
            f"{ctx.where()} {fqn}: placements {param.placements}"
        )
        assert param.device_mesh.size() == ctx.world_size, (
            f"{ctx.where()} {fqn}: mesh {param.device_mesh}"
        )
        assert param.requires_grad == requires_grad, (
            f"{ctx.where()} {fqn}: requires_grad {param.requires_grad}, expected {requires_grad}"
        )


@check(area="layout", requires={base.FLAT_PARAM}, cases=SHAPE_CASES)
def flat_param_shard(ctx, **case):
    """The flat parameter is the concatenation of the flattened parameters; rank r holds elements
    [r*ceil(N/ws), ...) of it followed by zero padding up to ceil(N/ws)."""
    shapes = _shapes(ctx, **case)
    model = ParamBag(shapes)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = torch.cat([p.reshape(-1) for p in originals.values()])
    start, end, chunk = flat_range(flat.numel(), ctx.world_size, ctx.rank)
    model = ctx.impl.shard(model, ctx)
    flats = ctx.impl.flat_shards(model)
    assert len(flats) == 1, f"{ctx.where()} expected one flat parameter, got {len(flats)}"
    fqns, shard = flats[0]
    assert list(fqns) == list(originals), (
        f"{ctx.where()} flattened order {fqns} != {list(originals)}"
    )
    assert shard.dim() == 1 and shard.numel() == chunk, (
        f"{ctx.where()} flat shard shape {tuple(shard.shape)}, expected ({chunk},) = ceil({flat.numel()}/{ctx.world_size})"
    )
    assert torch.equal(shard[: end - start].cpu(), flat[start:end]), (
        f"{ctx.where()} flat shard is not elements {start}:{end} of the flattened parameters"
    )
    assert not shard[end - start :].any(), (
        f"{ctx.where()} padding {end - start}:{chunk} of the flat shard is not zero"
    )


@check(area="layout", requires={base.FLAT_PARAM}, cases=SHAPE_CASES)
def flat_param_views(ctx, **case):
    """Each original parameter's piece on a rank is the intersection of its flat range with the rank's."""
    shapes = _shapes(ctx, **case)
    model = ParamBag(shapes)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(p.numel() for p in originals.values())
    start, end, _ = flat_range(total, ctx.world_size, ctx.rank)
    views = ctx.impl.local_shards(ctx.impl.shard(model, ctx))
    offset = 0
    for fqn, orig in originals.items():
        lo, hi = max(start, offset), min(end, offset + orig.numel())
        expected = orig.reshape(-1)[lo - offset : hi - offset] if lo < hi else orig.reshape(-1)[:0]
        view = views[fqn]
        assert torch.equal(view.local.cpu(), expected), (
            f"{ctx.where()} {fqn}: local piece has {view.local.numel()} elements "
            f"{view.local.tolist()[:6]}, expected elements {lo - offset}:{hi - offset} of the parameter"
        )
        if lo < hi:
            assert view.offset == lo - offset, (
                f"{ctx.where()} {fqn}: offset {view.offset} != {lo - offset}"
            )
        offset += orig.numel()
