"""Area "state_dict": what each kind of state dict holds, and that every kind loads back.

[Note: the kinds and their rules] (spec §2 S1-S23, §3 P8-P9)
full (FSDP1 FULL, FSDP2 ``dcp-full``): exactly the unwrapped model's keys and values, plain tensors
    cloned from the parameters (never views), on the compute device, or on the CPU with
    ``offload_to_cpu``; with ``rank0_only`` (and DCP ``full + cpu_offload``) other ranks get ``{}``.
sharded (FSDP1 SHARDED, FSDP2 ``dtensor`` / ``dcp-sharded``): the unwrapped model's keys; per
    original parameter a ShardedTensor or DTensor whose local piece is ``torch.chunk(p, ws, 0)[rank]``
    at row offset ``ceil(d0/ws)*rank``; a rank past the last chunk holds no rows.
local (FSDP1 LOCAL): per flat parameter ``<unit>._flat_param``, a 1-D ShardedTensor of the
    unpadded flat size N; rank r holds elements ``[r*ceil(N/ws), min((r+1)*ceil(N/ws), N))``, and
    no local shard when that range is empty (pure padding).
Every kind: persistent buffers under clean names, non-persistent buffers never, no
``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.`` in any key, and the dict loads back
(a fresh model with other values ends up with the saved values). Expected values come from an
unwrapped copy of the model (trained on the global batch where the check trains), never from the
implementation under test. At world size 1 FSDP1 clamps to NO_SHARD and every kind is FULL (S8).
This module checks what each kind holds (keys, values, buffers, world size 1), that it loads back,
and FSDP1's ``state_dict_type`` context. Beside it in ``state_dict/``: ``structures.py`` (shared
parameters, ignored modules, activation checkpointing), ``bad_input.py`` (loads that must fail),
``fsdp1.py`` (FSDP1 depth: meshes, unmanaged modules, offload, prefixes), ``reshard.py``
(resharding and cross-implementation loads), ``checkpoint_flow.py`` (train, save, load, train on).
Models and the kind-aware assertions are in ``_shared/sd_models.py``. FSDP2's own aliasing /
reshard-before-save / assign rules (P8, P9) are the ``fsdp2_state_dict`` area's
(``fully_shard/state_dict.py``).
"""

from __future__ import annotations

import warnings

import torch

from conformance.adapters import base
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import (
    AREA,
    KIND_CASES,
    NET_PLAN,
    Net,
    assert_clean_keys,
    assert_entry,
    assert_loaded,
    broadcast_from_rank0,
    build,
    expected_state_dict,
    first_error_everywhere,
    is_full_kind,
    plain_reference,
    require_kind,
    train,
)
from conformance.registry import check


# ---------------------------------------------------------------------------------------- keys
@check(area=AREA, cases=KIND_CASES)
def keys(ctx, kind):
    """S1/S7/S16: full, sharded and DTensor kinds have exactly the unwrapped model's keys
    (persistent buffers in, non-persistent out); LOCAL has ``<unit>._flat_param`` per flat
    parameter plus the persistent buffers; no key carries a wrapper prefix."""
    require_kind(ctx, kind)
    expected = set(Net().state_dict())
    if kind == "local" and ctx.world_size > 1:
        units = [fqn for fqn, _ in NET_PLAN]
        expected = {f"{u}._flat_param" if u else "_flat_param" for u in units}
        expected |= {n for n, _ in Net().named_buffers() if n != "scratch"}
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(build(ctx), kind))
    assert_clean_keys(ctx, sd)
    assert set(sd) == expected, (
        f"{ctx.where()} {kind} keys: extra {sorted(set(sd) - expected)}, missing {sorted(expected - set(sd))}"
    )


# -------------------------------------------------------------------------------------- values
FULL_CASES = {
    "full": {"kind": "full", "config": {}},
    "full-rank0_only": {"kind": "full", "config": {"rank0_only": True}},
    "full-offload_to_cpu": {"kind": "full", "config": {"offload_to_cpu": True}},
    "full-rank0_only-offload_to_cpu": {
        "kind": "full",
        "config": {"rank0_only": True, "offload_to_cpu": True},
    },
    "dcp-full": {"kind": "dcp-full", "config": {}},
    "dcp-full-cpu_offload": {"kind": "dcp-full", "config": {"cpu_offload": True}},
}


def _trained(ctx, kind, **config):
    """The unwrapped model trained on the global batch (and its expected state dict), the sharded
    model trained the same way, and the sharded model's ``kind`` state dict."""
    ref = Net()
    train(ref, ctx, local=True)
    model = build(ctx)
    train(model, ctx)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind, **config))
    return ref, expected_state_dict(ref), model, sd


# timeout 3: a passing case takes well under a second (0.3 s at ws 4 on 2 cores, 1.9 s at load 7);
# the upstream FSDP1 rank0_only + offload_to_cpu case hangs (expected failure), and each second of
# its wait is paid once per world size 2-4.
@check(area=AREA, requires={base.TRAINING}, cases=FULL_CASES, timeout=3)
def full_values(ctx, kind, config):
    """S2-S4: after two training steps the full state dict equals the unwrapped model trained on
    the global batch; plain cloned tensors (they keep their values after the model trains on); on
    the CPU with offload; with rank0_only (DCP: full + cpu_offload) ranks other than 0 get {}."""
    require_kind(ctx, kind)
    ref, expected, model, sd = _trained(ctx, kind, **config)
    train(model, ctx, steps=1)  # the parameters move on: a view into them would move too
    live = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel():
            live.add(local.untyped_storage().data_ptr())
    rank0_only = config.get("rank0_only") or config.get("cpu_offload")
    if rank0_only and ctx.rank != 0:
        assert sd == {}, (
            f"{ctx.where()} rank0_only: expected {{}} on this rank, got keys {sorted(sd)[:6]}"
        )
        return
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), (
        f"{ctx.where()} keys: extra {sorted(set(sd) - set(expected))}, missing {sorted(set(expected) - set(sd))}"
    )
    offload = config.get("offload_to_cpu") or config.get("cpu_offload")
    device_type = "cpu" if offload else ctx.device.type
    params = dict(ref.named_parameters())
    for name, exp in expected.items():
        got = sd[name]
        assert got.device.type == device_type, (
            f"{ctx.where()} {name} on {got.device}, expected {device_type}"
        )
        assert_entry(ctx, name, got, exp, full=True, exact=False)
        if name in params and got.numel():
            assert got.untyped_storage().data_ptr() not in live, (
                f"{ctx.where()} {name}: the state-dict tensor shares storage with a live parameter "
                "(expected a clone)"
            )


@check(
    area=AREA,
    requires={base.TRAINING},
    min_world_size=2,
    cases={k: {"kind": k} for k in ("sharded", "dtensor", "dcp-sharded")},
)
def sharded_values(ctx, kind):
    """S5/S6/P8: after two training steps each parameter's entry is a ShardedTensor or DTensor
    whose local piece equals rows [r*ceil(d0/ws), ...) of the unwrapped trained parameter, at that
    offset; ranks past the last chunk hold no rows; buffers are plain tensors."""
    require_kind(ctx, kind)
    ref, expected, model, sd = _trained(ctx, kind)
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), f"{ctx.where()} keys {sorted(sd)} != {sorted(expected)}"
    params = dict(ref.named_parameters())
    for name, exp in expected.items():
        assert_entry(ctx, name, sd[name], exp, full=name not in params, exact=False)


@check(area=AREA, requires={base.LOCAL_STATE_DICT}, min_world_size=2)
def local_values(ctx):
    """S7: ``<unit>._flat_param`` is a 1-D ShardedTensor of the unit's unpadded numel N (its
    parameters flattened in registration order); rank r's local shard is elements
    [r*ceil(N/ws), min((r+1)*ceil(N/ws), N)) at that offset, none on a pure-padding rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    plain = Net()
    model = build(ctx)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "local"))
    units = [fqn for fqn, _ in NET_PLAN]
    for unit in units:
        owned = [
            (n, p)
            for n, p in plain.named_parameters()
            if (n.startswith(unit + ".") or unit == "")
            and not any(
                u != unit and u.startswith(unit) and n.startswith(u + ".") for u in units if u
            )
        ]
        flat = torch.cat([p.detach().reshape(-1) for _, p in owned])
        start, end, chunk = flat_range(flat.numel(), ctx.world_size, ctx.rank)
        key = f"{unit}._flat_param" if unit else "_flat_param"
        got = sd.get(key)
        assert isinstance(got, ShardedTensor), (
            f"{ctx.where()} {key}: {type(got).__name__}, expected a ShardedTensor"
        )
        size = tuple(got.metadata().size)
        assert size == (flat.numel(),), (
            f"{ctx.where()} {key}: global size {size}, expected ({flat.numel()},) = unpadded numel of "
            f"{[n for n, _ in owned]}"
        )
        shards = got.local_shards()
        if end == start:
            assert not shards, (
                f"{ctx.where()} {key}: pure-padding rank holds {len(shards)} local shard(s)"
            )
            continue
        assert len(shards) == 1, f"{ctx.where()} {key}: {len(shards)} local shards, expected 1"
        offset = list(shards[0].metadata.shard_offsets)
        assert offset == [chunk * ctx.rank], (
            f"{ctx.where()} {key}: offset {offset}, expected [{chunk * ctx.rank}]"
        )
        local = shards[0].tensor.detach().cpu()
        assert torch.equal(local, flat[start:end]), (
            f"{ctx.where()} {key}: local shard {local.tolist()[:6]} (numel {local.numel()}), expected "
            f"elements {start}:{end} of the flattened parameters, padding stripped"
        )


# ---------------------------------------------------------------------------------- round trips
ROUND_TRIP_CASES = {
    "full": {"kind": "full", "config": {}},
    "full-rank0_only": {"kind": "full", "config": {"rank0_only": True}},
    "sharded": {"kind": "sharded", "config": {}},
    "local": {"kind": "local", "config": {}},
    "dtensor": {"kind": "dtensor", "config": {}},
    "dcp-full": {"kind": "dcp-full", "config": {}},
    "dcp-full-cpu_offload": {"kind": "dcp-full", "config": {"cpu_offload": True}},
    "dcp-sharded": {"kind": "dcp-sharded", "config": {}},
}


@check(area=AREA, cases=ROUND_TRIP_CASES)
def round_trip(ctx, kind, config):
    """S2/S5/S7/P8: save, build a fresh model with other values, load: its parameters and
    persistent buffers equal the saved ones; its non-persistent buffer keeps its own value. A
    rank-0-only dict is broadcast first, as upstream's tests do."""
    require_kind(ctx, kind)
    sd = first_error_everywhere(
        ctx, lambda: ctx.impl.state_dict(build(ctx, salt=0), kind, **config)
    )
    if config.get("rank0_only") or config.get("cpu_offload"):
        sd = broadcast_from_rank0(ctx, sd)
    dst = build(ctx, salt=1)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    expected = plain_reference(Net, 0)
    assert_loaded(ctx, dst, expected, f"after loading a {kind} state dict")
    scratch = [b for n, b in dst.named_buffers() if ctx.impl.clean_fqn(n) == "scratch"]
    assert scratch and torch.equal(scratch[0].cpu(), Net(1).scratch), (
        f"{ctx.where()} the non-persistent buffer changed on load (it is never saved)"
    )


BUFFER_CASES = dict(KIND_CASES)
BUFFER_CASES |= {
    f"{k}-mixed_precision": {"kind": k, "mixed_precision": True} for k in ("full", "sharded")
}


@check(area=AREA, cases=BUFFER_CASES)
def buffers(ctx, kind, mixed_precision=False):
    """S12/S13: persistent buffers appear under clean names with their own values, the
    non-persistent one never; with fp16 mixed precision the dict holds buffers and parameters in
    their original dtype (fp32) while the module's buffers stay fp16, and they load back."""
    require_kind(ctx, kind)
    options = {}
    if mixed_precision:
        ctx.require(base.MIXED_PRECISION)
        options["mixed_precision"] = {"param_dtype": torch.float16, "buffer_dtype": torch.float16}
    model = build(ctx, **options)
    if mixed_precision:
        model(torch.ones(2, 4, device=ctx.device))  # lazy init (casts buffers under buffer MP)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    plain = Net()
    expected = {n: b for n, b in plain.named_buffers() if n != "scratch"}
    for key in sd:
        assert not key.endswith("scratch"), f"{ctx.where()} non-persistent buffer saved as {key!r}"
    for name, exp in expected.items():
        assert name in sd, (
            f"{ctx.where()} persistent buffer {name} missing from the {kind} dict ({sorted(sd)})"
        )
        assert_entry(ctx, name, sd[name], exp, full=True)
    if mixed_precision:  # S13: parameters are saved in their original dtype too
        for name, param in plain.named_parameters():
            assert_entry(ctx, name, sd[name], param.detach(), full=is_full_kind(ctx, kind))
    if mixed_precision and base.FLAT_PARAM in ctx.impl.capabilities:
        dtypes = {ctx.impl.clean_fqn(n): b.dtype for n, b in model.named_buffers()}
        assert dtypes["buf"] == torch.float16, (
            f"{ctx.where()} module buffer dtype after save {dtypes}, expected fp16"
        )
    dst = build(ctx, salt=1, **options)
    if mixed_precision:
        dst(torch.ones(2, 4, device=ctx.device))
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    got = {ctx.impl.clean_fqn(n): b.detach().cpu().float() for n, b in dst.named_buffers()}
    for name, exp in expected.items():
        assert torch.equal(got[name], exp), (
            f"{ctx.where()} buffer {name} after load {got[name].tolist()} != {exp.tolist()}"
        )


# ------------------------------------------------------------------------------ world size 1
@check(
    area=AREA,
    requires={base.FLAT_PARAM},
    world_sizes=(1,),
    cases={k: {"kind": k} for k in ("sharded", "local")},
)
def world_size_one(ctx, kind):
    """S8: at world size 1 FSDP1 runs NO_SHARD, so SHARDED and LOCAL return FULL plain tensors
    (warning "full_state_dict will be returned"), and they load back."""
    require_kind(ctx, kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = ctx.impl.state_dict(build(ctx), kind)
    expected = plain_reference(Net, 0)
    assert set(sd) == set(expected), f"{ctx.where()} keys {sorted(sd)} != {sorted(expected)}"
    for name, exp in expected.items():
        assert_entry(ctx, name, sd[name], exp, full=True)
    texts = [str(w.message) for w in caught]
    assert any("full_state_dict will be returned" in t for t in texts), (
        f"{ctx.where()} no NO_SHARD warning ('full_state_dict will be returned'); got {texts[:3]}"
    )
    dst = build(ctx, salt=1)
    ctx.impl.load_state_dict(dst, sd, kind)
    assert_loaded(ctx, dst, expected, f"after loading a {kind} state dict at world size 1")


# ------------------------------------------------------------------------------ FSDP1 API
@check(area=AREA, requires={base.FSDP1_API})
def state_dict_type_context(ctx):
    """S9/S10: ``FSDP.state_dict_type(...)`` restores the previous type on exit (the default FULL
    or one set before); a config of the wrong class raises RuntimeError("Expected
    state_dict_config of type ...") and changes nothing."""
    ns = ctx.impl.ns
    FSDP, T = ns.FullyShardedDataParallel, ns.StateDictType
    model = build(ctx)

    def current():
        return {m._state_dict_type for m in FSDP.fsdp_modules(model)}

    assert current() == {T.FULL_STATE_DICT}, f"{ctx.where()} initial types {current()}"
    with FSDP.state_dict_type(model, T.LOCAL_STATE_DICT):
        assert current() == {T.LOCAL_STATE_DICT}, f"{ctx.where()} inside the context: {current()}"
    assert current() == {T.FULL_STATE_DICT}, (
        f"{ctx.where()} after the context: {current()}, expected FULL"
    )
    FSDP.set_state_dict_type(model, T.SHARDED_STATE_DICT)
    with FSDP.state_dict_type(model, T.LOCAL_STATE_DICT):
        pass
    assert current() == {T.SHARDED_STATE_DICT}, (
        f"{ctx.where()} after the context: {current()}, expected SHARDED"
    )
    try:
        with FSDP.state_dict_type(model, T.FULL_STATE_DICT, ns.LocalStateDictConfig()):
            pass
    except RuntimeError as exc:
        assert "Expected state_dict_config of type" in str(exc), f"{ctx.where()} message: {exc}"
    else:
        raise AssertionError(
            f"{ctx.where()} FULL_STATE_DICT with LocalStateDictConfig did not raise"
        )
    assert current() == {T.SHARDED_STATE_DICT}, (
        f"{ctx.where()} a failed state_dict_type changed the type: {current()}"
    )
