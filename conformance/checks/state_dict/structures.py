"""Area "state_dict", model structures: shared parameters and modules, ignored modules and
activation checkpointing keep the unwrapped model's keys and load back (S14-S16).

The kinds and their rules are in ``kinds.py``'s Note; the models (``TiedNet``, ``CheckpointedNet``)
and the kind-aware assertions in ``_shared/sd_models.py``.
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks._shared.sd_models import (
    AC_PLAN,
    AREA,
    KIND_CASES,
    CheckpointedNet,
    Net,
    TiedNet,
    assert_clean_keys,
    assert_entry,
    assert_loaded,
    build,
    expected_state_dict,
    first_error_everywhere,
    is_full_kind,
    plain_reference,
    require_kind,
)
from conformance.registry import check


@check(area=AREA, cases=KIND_CASES)
def shared_params(ctx, kind):
    """S15: a shared module (net3 is net2) and a shared parameter (shared_parameter is
    random_parameter) keep every alias key with the aliased value, and load back."""
    require_kind(ctx, kind)
    expected = plain_reference(TiedNet, 0)
    sd = first_error_everywhere(
        ctx, lambda: ctx.impl.state_dict(build(ctx, TiedNet, plan=None), kind)
    )
    assert_clean_keys(ctx, sd)
    if kind != "local" or is_full_kind(ctx, kind):
        assert set(sd) == set(expected), (
            f"{ctx.where()} keys: extra {sorted(set(sd) - set(expected))}, missing {sorted(set(expected) - set(sd))}"
        )
        for name, exp in expected.items():
            assert_entry(ctx, name, sd[name], exp, full=is_full_kind(ctx, kind))
    dst = build(ctx, TiedNet, salt=1, plan=None)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    assert_loaded(ctx, dst, expected, f"after loading a {kind} state dict")


@check(
    area=AREA,
    requires={base.FLAT_PARAM, base.AUTO_WRAP},
    cases={k: {"kind": k} for k in ("full", "sharded")},
)
def ignored_modules(ctx, kind):
    """S14: with ``ignored_modules=[outer]`` the keys equal the unwrapped model's; the ignored
    parameters are saved as plain tensors, uncloned under FULL (the live tensor itself), and a
    FULL dict loads strictly into an unwrapped model."""
    require_kind(ctx, kind)
    raw = Net(0).to(ctx.device)
    model = ctx.impl.shard(raw, ctx, plan=[("inner", {}), ("", {})], ignored_modules=[raw.outer])
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    expected = plain_reference(Net, 0)
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), f"{ctx.where()} keys {sorted(sd)} != {sorted(expected)}"
    params = dict(Net().named_parameters())
    for name, exp in expected.items():
        ignored = name.startswith("outer.")
        assert_entry(
            ctx, name, sd[name], exp, full=ignored or name not in params or is_full_kind(ctx, kind)
        )
    if is_full_kind(ctx, kind):
        live = raw.outer.weight
        assert sd["outer.weight"].data_ptr() == live.data_ptr(), (
            f"{ctx.where()} ignored parameter outer.weight was cloned (expected the live tensor)"
        )
        plain = Net(1)
        plain.load_state_dict(sd)
        for name, value in plain.state_dict().items():
            assert torch.equal(value, expected[name]), (
                f"{ctx.where()} unwrapped load: {name} differs"
            )
    raw2 = Net(1).to(ctx.device)
    dst = ctx.impl.shard(raw2, ctx, plan=[("inner", {}), ("", {})], ignored_modules=[raw2.outer])
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    assert_loaded(ctx, dst, expected, f"after loading a {kind} state dict")
    assert torch.equal(raw2.outer.weight.detach().cpu(), expected["outer.weight"]), (
        f"{ctx.where()} ignored parameter outer.weight not loaded"
    )


@check(
    area=AREA,
    cases={k: {"kind": k} for k in ("full", "sharded", "dtensor", "dcp-full", "dcp-sharded")},
)
def activation_checkpoint(ctx, kind):
    """S16: a model whose ``inner`` is ``checkpoint_wrapper``-ed has the plain model's keys (no
    ``_checkpoint_wrapped_module``), and its dict loads into the plain model and back."""
    require_kind(ctx, kind)
    expected = expected_state_dict(CheckpointedNet(0, wrap_ac=False))
    src = build(ctx, CheckpointedNet, salt=0, plan=AC_PLAN)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(src, kind))
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), f"{ctx.where()} keys {sorted(sd)} != {sorted(expected)}"
    if is_full_kind(ctx, kind):
        plain = CheckpointedNet(1, wrap_ac=False)
        plain.load_state_dict(sd)  # strict
    dst = ctx.impl.shard(CheckpointedNet(1, wrap_ac=False).to(ctx.device), ctx, plan=AC_PLAN)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    assert_loaded(ctx, dst, expected, f"AC source -> plain destination ({kind})")
    back = ctx.impl.state_dict(dst, kind)
    dst_ac = build(ctx, CheckpointedNet, salt=2, plan=AC_PLAN)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst_ac, back, kind))
    assert_loaded(ctx, dst_ac, expected, f"plain source -> AC destination ({kind})")
