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
Resharding and cross-implementation loads live in ``state_dict_reshard.py``; models and the
kind-aware assertions in ``_sd_models.py``. FSDP2's own aliasing / reshard-before-save / assign
rules (P8, P9) are the ``fsdp2_state_dict`` area's.
"""

from __future__ import annotations

import re
import warnings

import torch

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.sd_models import (
    AC_PLAN,
    AREA,
    KIND_CASES,
    NET_PLAN,
    CheckpointedNet,
    Net,
    TiedNet,
    assert_clean_keys,
    assert_entry,
    assert_loaded,
    broadcast_from_rank0,
    build,
    expected_state_dict,
    first_error_everywhere,
    full_params,
    is_full_kind,
    plain_reference,
    require_kind,
    train,
)
from conformance.checks.fully_shard.layout import flat_range
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


# timeout 10: a passing case takes well under a second (0.3 s at ws 4 on 2 cores); the upstream
# FSDP1 rank0_only + offload_to_cpu case hangs (expected failure), and each second of its wait is
# paid once per world size.
@check(area=AREA, requires={base.TRAINING}, cases=FULL_CASES, timeout=10)
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


# ------------------------------------------------------------------------- model structures
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


@check(area=AREA, cases={k: {"kind": k} for k in ("full", "sharded")})
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


# ----------------------------------------------------------------------------- loading errors
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
