"""Area "fsdp1_runtime": what ``FullyShardedDataParallel`` shows of itself (R8-R10), and the names
it gives a module's parameters and buffers (R84, R85).

[Note: the wrapper's names and its flat parameter]
A unit registers the module it wraps as ``_fsdp_wrapped_module``, so outside
``summon_full_params`` the names ``named_parameters()`` gives carry that component
(``_fsdp_wrapped_module.inner._fsdp_wrapped_module._flat_param`` with ``use_orig_params=False``,
``_fsdp_wrapped_module.inner._fsdp_wrapped_module.weight`` with True); inside it they are the
unwrapped model's (``inner.weight``). ``unit._flat_param`` is the unit's FlatParameter (with
``use_orig_params=False`` the very Parameter registered as ``_flat_param``), None for a unit that
manages no parameter. ``summon_full_params`` is a static method: ``FSDP.summon_full_params(m)``,
``m.summon_full_params(m, recurse=False)`` and ``other_unit.summon_full_params(m)`` all act on
``m``.

[Note: the names of a wrapped module's tensors]
* A module may override ``named_parameters`` without supporting ``remove_duplicate=False``
  (asserting it is True, as some wrappers do): FSDP1 still wraps it, its state dict holds the
  unsharded model's entries, and its forward is the unsharded model's (R84).
* ``named_buffers()`` of an FSDP1 module names its buffers as ``nn.Module`` does (through the
  ``_fsdp_wrapped_module.`` attribute) outside ``summon_full_params``, and by the unwrapped
  module's FQNs inside it (R85).

[Note: the flat layout, field by field]
Upstream's flat parameter records its layout as ``_numels_with_padding`` (segments),
``_is_padding_mask``, ``_shard_numel_padded`` and per original parameter a ``_ShardParamInfo``
(in_shard, offset_in_shard, numel_in_shard, intra_param_start_idx, intra_param_end_idx; all but
in_shard None where the parameter has no element in the shard). The rule (R10): with
``use_orig_params=False`` the segments are the parameters' numels; with True every parameter
starts at a multiple of ``a = 16 bytes / element size`` (a padding segment before it where
needed) and a last padding segment makes the total a multiple of ws. Rank r's shard is
``[r*C, (r+1)*C)`` of the total T with ``C = ceil(T/ws)``; ``_shard_numel_padded`` is
``C - (elements of T in the shard)``. A parameter's info is the intersection of its segment
with the shard, the end index inclusive. These are read through the adapter's ``_flat_params``
(what ``flat_shards`` reads); an adapter without it is NotSupported.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _global_batch, _kwargs
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.checks.fsdp1.summon_full_params import (
    ORIG,
    assert_full,
    assert_params,
    build,
    expect_refusal,
)
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}
WRAPPED = "_fsdp_wrapped_module"


def raw_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, cases=ORIG)
def wrapped_names(ctx, orig):
    """R8: outside ``summon_full_params`` ``named_parameters()`` of the root names every tensor
    with its ``_fsdp_wrapped_module.`` components (the flat parameters with
    ``use_orig_params=False``, the original parameters with True); inside it the names are the
    unwrapped model's, and after exit the wrapped names are back."""
    model, oracle, FSDP = build(ctx, orig)
    inner = f"{WRAPPED}.inner.{WRAPPED}."
    if orig:
        wrapped = [f"{inner}weight", f"{inner}bias", f"{WRAPPED}.head.weight"]
        wrapped.append(f"{WRAPPED}.head.bias")
    else:
        wrapped = [f"{WRAPPED}._flat_param", f"{inner}_flat_param"]
    clean = [n for n, _ in oracle.named_parameters()]
    got = raw_names(model)
    assert sorted(got) == sorted(wrapped), (
        f"{ctx.where()} named_parameters() outside summon_full_params: {got}, expected {wrapped}"
    )
    with FSDP.summon_full_params(model, writeback=False):
        inside = raw_names(model)
        assert sorted(inside) == sorted(clean), (
            f"{ctx.where()} named_parameters() inside summon_full_params: {inside}, expected the "
            f"unwrapped model's {clean}"
        )
    after = raw_names(model)
    assert sorted(after) == sorted(wrapped), (
        f"{ctx.where()} named_parameters() after summon_full_params: {after}, expected {wrapped}"
    )


class InnerOnly(nn.Module):
    """The root manages no parameter: ``lin`` (its own unit) holds them all."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def flat_param_attribute(ctx, orig):
    """R9: ``unit._flat_param`` is the unit's flat parameter: with ``use_orig_params=False`` the
    Parameter ``named_parameters()`` gives as ``<unit>._flat_param`` (the same object), with True
    a 1-D Parameter; a unit that manages no parameter has ``_flat_param`` None."""
    model, _, FSDP = build(ctx, orig)
    units = {n: m for n, m in model.named_modules() if isinstance(m, FSDP)}
    params = dict(model.named_parameters())
    for name, unit in units.items():
        flat = unit._flat_param
        assert isinstance(flat, nn.Parameter) and flat.dim() == 1, (
            f"{ctx.where()} unit {name or '<root>'}: _flat_param is {type(flat).__name__}, "
            "expected its 1-D flat Parameter"
        )
        if not orig:
            key = f"{name}.{WRAPPED}._flat_param" if name else f"{WRAPPED}._flat_param"
            assert params.get(key) is flat, (
                f"{ctx.where()} unit {name or '<root>'}: _flat_param is not the Parameter "
                f"registered as {key}"
            )
    ctx.seed(0)
    empty = ctx.impl.shard(InnerOnly().to(ctx.device), ctx, plan=[("lin", {}), ("", {})])
    assert empty._flat_param is None, (
        f"{ctx.where()} a root that manages no parameter has _flat_param "
        f"{type(empty._flat_param).__name__}, expected None"
    )
    (lin,) = [m for n, m in empty.named_modules() if n and isinstance(m, FSDP)]
    assert lin._flat_param is not None, f"{ctx.where()} the lin unit's _flat_param is None"


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, cases=ORIG)
def summon_static_method(ctx, orig):
    """R3: ``summon_full_params`` is a static method: called through a unit,
    ``model.summon_full_params(model, recurse=False, writeback=False)`` takes the keywords and
    shows the root's own parameters, and ``inner.summon_full_params(model, writeback=False)``
    acts on ``model`` (every parameter full), not on ``inner``."""
    model, oracle, FSDP = build(ctx, orig)
    inner = next(m for n, m in model.named_modules() if n and isinstance(m, FSDP))
    with model.summon_full_params(model, recurse=False, writeback=False):
        assert_full(
            ctx,
            model,
            oracle,
            "inside model.summon_full_params(model, recurse=False)",
            {"head.weight", "head.bias"},
        )
    with inner.summon_full_params(model, writeback=False):
        assert_full(ctx, model, oracle, "inside inner.summon_full_params(model)")
    assert_params(ctx, model, dict(oracle.named_parameters()), "after the summons")
    expect_refusal(
        ctx,
        "model.summon_full_params(model) inside FSDP.summon_full_params(model)",
        AssertionError,
        "already unsharding",
        lambda: _nested(FSDP, model),
    )


@contextlib.contextmanager
def _nested(FSDP, model):  # noqa: N803 - upstream's class name
    """``model.summon_full_params(model)`` entered inside ``FSDP.summon_full_params(model)``."""
    outer = FSDP.summon_full_params(model, writeback=False)
    with outer, model.summon_full_params(model, writeback=False):
        yield


# ------------------------------------------------------------------------------ flat layout
LAYOUT_FIELDS = ("_numels_with_padding", "_is_padding_mask", "_shard_numel_padded")


def layout_rule(numels, world_size, rank, align):
    """(segments, mask, shard numel padded, infos, shard numel) by the rule of the Note."""
    segments, mask, total = [], [], 0
    for n in numels:
        if align and total % align:
            segments.append(align - total % align)
            mask.append(True)
            total += segments[-1]
        segments.append(n)
        mask.append(False)
        total += n
    if align and total % world_size:
        segments.append(world_size - total % world_size)
        mask.append(True)
        total += segments[-1]
    chunk = math.ceil(total / world_size)
    start, end = min(rank * chunk, total), min((rank + 1) * chunk, total)
    infos, offset = [], 0
    for n, pad in zip(segments, mask):
        lo, hi = max(offset, start), min(offset + n, end)
        if not pad:
            if lo < hi:
                infos.append((True, lo - start, hi - lo, lo - offset, hi - offset - 1))
            else:
                infos.append((False, None, None, None, None))
        offset += n
    return segments, mask, chunk - (end - start), infos, chunk


@check(area="layout", requires={base.FLAT_PARAM, base.FSDP1_API, base.AUTO_WRAP}, cases=ORIG)
def flat_layout_fields(ctx, orig):
    """R10: every unit's flat parameter records the layout of the rule: ``_numels_with_padding``
    and ``_is_padding_mask`` (alignment padding before a parameter and a last padding segment
    up to a multiple of ws with ``use_orig_params=True``, none with False),
    ``_shard_numel_padded``, the shard's numel ``ceil(T/ws)`` and each parameter's
    ``_ShardParamInfo`` (offset, numel, start and inclusive end index in the parameter)."""
    model, oracle, _ = build(ctx, orig)
    read = getattr(ctx.impl, "_flat_params", None)
    if read is None:
        raise base.NotSupported("the flat parameters' layout metadata (adapter._flat_params)")
    units = {prefix: flat for prefix, flat in read(model)}
    names = {"inner": ["inner.weight", "inner.bias"], "": ["head.weight", "head.bias"]}
    originals = dict(oracle.named_parameters())
    assert sorted(units) == sorted(names), f"{ctx.where()} flat parameters of {sorted(units)}"
    for prefix, flat in units.items():
        missing = [f for f in (*LAYOUT_FIELDS, "_shard_param_infos") if not hasattr(flat, f)]
        if missing:
            raise base.NotSupported(f"flat parameter layout fields {missing}")
        align = 16 // flat.element_size() if orig else 0
        segments, mask, padded, infos, chunk = layout_rule(
            [originals[n].numel() for n in names[prefix]], ctx.world_size, ctx.rank, align
        )
        unit = prefix or "<root>"
        got = (list(flat._numels_with_padding), list(flat._is_padding_mask))
        assert got == (segments, mask), (
            f"{ctx.where()} unit {unit}: (_numels_with_padding, _is_padding_mask) {got}, "
            f"expected {(segments, mask)}"
        )
        assert flat._shard_numel_padded == padded, (
            f"{ctx.where()} unit {unit}: _shard_numel_padded {flat._shard_numel_padded}, "
            f"expected {padded}"
        )
        assert flat.numel() == chunk, (
            f"{ctx.where()} unit {unit}: shard numel {flat.numel()}, expected {chunk}"
        )
        got_infos = [tuple(i) for i in flat._shard_param_infos]
        assert got_infos == infos, (
            f"{ctx.where()} unit {unit}: _shard_param_infos {got_infos}, expected {infos}"
        )
        local = flat.detach().cpu()
        for info, name in zip(infos, names[prefix]):
            values = originals[name].detach().reshape(-1)
            if info[0]:
                _, off, n, lo, hi = info
                assert torch.equal(local[off : off + n], values[lo : hi + 1].cpu()), (
                    f"{ctx.where()} unit {unit}: shard elements {off}:{off + n} are not the "
                    f"parameter's {lo}..{hi}"
                )


# ------------------------------------------------------------------------------ R84
class _StrictNames(nn.Linear):
    """A Linear whose ``named_parameters`` refuses ``remove_duplicate=False``."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        assert remove_duplicate, "this module only names parameters without duplicates"
        return super().named_parameters(prefix, recurse)


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FULL_STATE_DICT}, world_sizes=(1, 2))
def named_parameters_without_remove_duplicate(ctx):
    """R84: FSDP1 (one unit) over ``Sequential(M(4, 4), Linear(4, 2))``, where ``M`` is a Linear
    whose ``named_parameters`` asserts ``remove_duplicate`` is True, constructs; its FULL state
    dict has exactly the keys ``0.weight``, ``0.bias``, ``1.weight``, ``1.bias`` with the unsharded
    model's values, and a forward (the same batch on every rank) equals the unsharded model's."""
    ctx.seed(0)
    oracle = nn.Sequential(_StrictNames(4, 4), nn.Linear(4, 2)).to(ctx.device)
    model = first_error_everywhere(ctx, lambda: ctx.impl.shard(copy.deepcopy(oracle), ctx))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = ctx.impl.state_dict(model, "full")
    want = {k: v.detach() for k, v in nn.Module.state_dict(oracle).items()}
    assert sorted(sd) == sorted(want), (
        f"{ctx.where()} FULL state dict keys {sorted(sd)}, expected {sorted(want)}"
    )
    for key, value in want.items():
        assert_close(ctx, f"FULL state dict {key}", sd[key].detach(), value, FP32["param"])
    x = _global_batch(ctx, 83)
    with torch.no_grad():
        assert_close(ctx, "forward", model(x), oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R85
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def named_buffers_in_summon(ctx):
    """R85: over one unit of ``Sequential(Linear(4, 4), BatchNorm1d(4))``, ``named_buffers()``
    gives, in the unwrapped module's order, ``_fsdp_wrapped_module.`` + each of its buffer names
    outside ``summon_full_params`` and the unwrapped names (``1.running_mean``, ...) inside it;
    the buffers are the same tensors either way."""
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(ctx.device)
    names = [n for n, _ in plain.named_buffers()]
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = fsdp(plain, **_kwargs(ctx))
    outside = list(model.named_buffers())
    want = [f"_fsdp_wrapped_module.{n}" for n in names]
    assert [n for n, _ in outside] == want, (
        f"{ctx.where()} named_buffers() outside summon_full_params: "
        f"{[n for n, _ in outside]}, expected {want}"
    )
    with fsdp.summon_full_params(model):
        inside = list(model.named_buffers())
    assert [n for n, _ in inside] == names, (
        f"{ctx.where()} named_buffers() inside summon_full_params: {[n for n, _ in inside]}, "
        f"expected the unwrapped module's {names}"
    )
    for (name, a), (_, b) in zip(outside, inside):
        assert a is b, f"{ctx.where()} buffer {name}: a different tensor inside summon_full_params"
