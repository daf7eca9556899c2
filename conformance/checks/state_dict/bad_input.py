"""Area "state_dict", loads that must fail or report: ``strict=False`` reports missing and
unexpected keys by clean name (S11), and a dict with a wrong shape, a missing key or the wrong tensor
type for its kind is refused on every rank, naming what is wrong (S2, S5, S7, P8).

The strict area runs ``bad_input`` again with ``strict=True`` (X3: a failed load changes nothing).
The kinds and their rules are in ``kinds.py``'s Note.
"""

from __future__ import annotations

import re

import torch

from conformance.adapters.base import NotSupported
from conformance.checks._shared.sd_models import (
    AREA,
    Net,
    build,
    first_error_everywhere,
    full_params,
    is_full_kind,
    plain_reference,
    require_kind,
)
from conformance.registry import check


@check(area=AREA, cases={k: {"kind": k} for k in ("full", "sharded", "dtensor")})
def incompatible_keys(ctx, kind):
    """S11: ``load_state_dict(strict=False)`` of a dict missing ``inner.weight`` and holding an
    extra ``unexpected`` reports exactly those clean names."""
    require_kind(ctx, kind)
    sd = ctx.impl.state_dict(build(ctx, salt=0), kind)
    sd = dict(sd)
    del sd["inner.weight"]
    sd["unexpected"] = torch.zeros(1, device=ctx.device)
    dst = build(ctx, salt=1)
    result = first_error_everywhere(
        ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind, strict=False)
    )
    missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    assert missing == ["inner.weight"], (
        f"{ctx.where()} missing keys {missing}, expected ['inner.weight']"
    )
    assert unexpected == ["unexpected"], (
        f"{ctx.where()} unexpected keys {unexpected}, expected ['unexpected']"
    )


def _bad_wrong_shape(ctx, sd, kind):
    if kind == "dtensor":
        from torch.distributed.tensor import Shard, distribute_tensor

        sd["outer.weight"] = distribute_tensor(
            torch.zeros(3, 3, device=ctx.device), ctx.mesh, [Shard(0)]
        )
    else:
        sd["outer.weight"] = torch.zeros(3, 3, device=ctx.device)


def _bad_missing_key(ctx, sd, kind):
    del sd["inner.bias"]


def _bad_plain_tensors(ctx, sd, kind):
    for key, value in plain_reference(Net, 0).items():
        sd[key] = value.to(ctx.device)


BAD_INPUT_CASES = {
    "full-wrong-shape": {"kind": "full", "bad": "wrong_shape"},
    "full-missing-key": {"kind": "full", "bad": "missing_key"},
    "sharded-plain-tensors": {"kind": "sharded", "bad": "plain_tensors"},
    "local-plain-tensors": {"kind": "local", "bad": "plain_tensors"},
    "dtensor-wrong-shape": {"kind": "dtensor", "bad": "wrong_shape"},
    "dtensor-missing-key": {"kind": "dtensor", "bad": "missing_key"},
    "dtensor-plain-tensors": {"kind": "dtensor", "bad": "plain_tensors"},
}


# what the error must name: the offending key, or the tensor type the kind expects
BAD_INPUT_NAMES = {
    "wrong_shape": r"outer\.weight",
    "missing_key": r"inner\.bias",
    "plain_tensors": r"ShardedTensor|DTensor",
}


@check(area=AREA, cases=BAD_INPUT_CASES)
def bad_input(ctx, kind, bad, strict=False):
    """A load of a dict with a wrong shape, a missing key under strict, or the wrong tensor type
    for the kind (plain tensors for SHARDED / LOCAL / DTensor) raises on every rank, naming the
    offending key or the expected tensor type (S2, S5, S7, P8). With ``strict`` (as the strict
    area runs it) the module's parameters and buffers also stay byte for byte what they were."""
    require_kind(ctx, kind)
    if bad == "plain_tensors" and is_full_kind(ctx, kind):
        raise NotSupported(f"at world size 1 {kind} is FULL (NO_SHARD, S8)")
    sd = dict(ctx.impl.state_dict(build(ctx, salt=0), kind))
    if kind == "local" and bad == "plain_tensors":
        sd = {k: torch.zeros(v.size()) if hasattr(v, "local_shards") else v for k, v in sd.items()}
    else:
        {
            "wrong_shape": _bad_wrong_shape,
            "missing_key": _bad_missing_key,
            "plain_tensors": _bad_plain_tensors,
        }[bad](ctx, sd, kind)
    dst = build(ctx, salt=1)
    if strict:
        before = full_params(ctx, dst)
        buffers_before = {n: b.detach().cpu().clone() for n, b in dst.named_buffers()}
    try:
        ctx.impl.load_state_dict(dst, sd, kind, strict=True)
    except Exception as exc:  # noqa: BLE001 - any error type; the message is checked below
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    errors = [None] * ctx.world_size
    if ctx.world_size > 1:
        torch.distributed.all_gather_object(errors, error)
    else:
        errors = [error]
    raised = [e is not None for e in errors]
    assert all(raised), (
        f"{ctx.where()} loading a {kind} dict with {bad}: raised on ranks {raised} (expected all)"
    )
    assert re.search(BAD_INPUT_NAMES[bad], error), (
        f"{ctx.where()} loading a {kind} dict with {bad}: the error {error[:300]!r} does not name "
        f"{BAD_INPUT_NAMES[bad]!r}"
    )
    if not strict:
        return
    after = full_params(ctx, dst)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    changed += sorted(
        n for n, b in dst.named_buffers() if not torch.equal(b.detach().cpu(), buffers_before[n])
    )
    assert not changed, f"{ctx.where()} the failed {kind} load ({bad}) changed {changed}"
