"""Area "state_dict": FSDP1 state dicts of models with entries no FSDP unit manages: a non-FSDP root,
a module attached after wrapping (S3, S18).

[Note: unmanaged entries]
``rank0_only`` empties only what FSDP manages on ranks other than 0 (its parameters and buffers);
entries of modules outside every FSDP unit - a non-FSDP root's own layers, a module attached to
the wrapped module after wrapping ("skip module") - stay on every rank as plain tensors with their
values (S3, S18). The models are ``fsdp1.py``'s and ``_shared/sd_models.py``'s.
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks._shared.sd_models import (
    AREA,
    NET_PLAN,
    Net,
    assert_clean_keys,
    assert_entry,
    assert_loaded,
    broadcast_from_rank0,
    first_error_everywhere,
    plain_reference,
    require_kind,
)
from conformance.checks.state_dict.fsdp1 import NonFsdpRoot
from conformance.registry import check


def build_with_skip(ctx, salt: int = 0):
    """``Net`` sharded with ``outer`` detached during wrapping and attached again afterwards: a
    module inside the wrapped module that no FSDP unit manages (upstream's SkipModel)."""
    raw = Net(salt).to(ctx.device)
    skipped = raw.outer
    del raw.outer
    model = ctx.impl.shard(raw, ctx, plan=NET_PLAN)
    raw.outer = skipped
    return model, raw


def _assert_unmanaged_dict(ctx, sd, expected, unmanaged, rank0_only, kind="full", sharded=()):
    """Rank 0 (every rank without rank0_only) has ``expected``; other ranks under rank0_only have
    exactly the ``unmanaged`` entries; unmanaged entries are plain tensors with their values, the
    ``sharded`` ones this rank's chunk."""
    want = set(expected) if ctx.rank == 0 or not rank0_only else set(unmanaged)
    assert_clean_keys(ctx, sd)
    assert set(sd) == want, (
        f"{ctx.where()} {kind}{' rank0_only' if rank0_only else ''} keys: extra "
        f"{sorted(set(sd) - want)}, missing {sorted(want - set(sd))} (entries outside every FSDP "
        "unit stay on every rank)"
    )
    for name in sorted(want):
        assert_entry(ctx, name, sd[name], expected[name], full=name not in sharded)


@check(area=AREA, requires={base.FULL_STATE_DICT, base.FSDP1_API}, min_world_size=2)
def non_fsdp_root_rank0_only(ctx):
    """S3: a plain (non-FSDP) root holding a plain Linear and an FSDP model: with ``rank0_only``
    rank 0 gets every entry, the other ranks only the plain Linear's (plain tensors, right
    values)."""
    root = NonFsdpRoot(ctx)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(root, "full", rank0_only=True))
    _assert_unmanaged_dict(ctx, sd, NonFsdpRoot.expected(), {"plain.weight", "plain.bias"}, True)


SKIP_CASES = {
    "full": {"kind": "full", "config": {}},
    "full-rank0_only": {"kind": "full", "config": {"rank0_only": True}},
    "sharded": {"kind": "sharded", "config": {}},
}


@check(area=AREA, requires={base.FSDP1_API}, cases=SKIP_CASES, min_world_size=2)
def skip_module(ctx, kind, config):
    """S18/S3: a module attached to the wrapped module after wrapping (managed by no unit) is saved
    under its clean names as plain tensors, on every rank even with rank0_only, next to the
    managed entries of the kind; the dict loads into a model built the same way (the skipped
    module's values too)."""
    require_kind(ctx, kind)
    model, _ = build_with_skip(ctx)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind, **config))
    expected = plain_reference(Net, 0)
    rank0_only = bool(config.get("rank0_only"))
    unmanaged = {"outer.weight", "outer.bias"}
    sharded = {n for n, _ in Net().named_parameters()} - unmanaged if kind == "sharded" else ()
    _assert_unmanaged_dict(ctx, sd, expected, unmanaged, rank0_only, kind, sharded)
    if rank0_only:
        sd = broadcast_from_rank0(ctx, sd)
    dst, raw = build_with_skip(ctx, salt=1)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    managed = {k: v for k, v in expected.items() if not k.startswith("outer.")}
    assert_loaded(ctx, dst, managed, f"after loading a {kind} dict")
    for name in ("weight", "bias"):
        got = getattr(raw.outer, name).detach().cpu()
        assert torch.equal(got, expected[f"outer.{name}"]), (
            f"{ctx.where()} skipped module outer.{name} after load {got.reshape(-1)[:4].tolist()}, "
            f"expected {expected[f'outer.{name}'].reshape(-1)[:4].tolist()}"
        )
