"""Area "state_dict", FSDP1 depth: device meshes, prefixes, ``use_orig_params=True``, zero-numel
parameters and load errors (S1, S5-S8, S14, S17, R74). Modules FSDP does not manage (S3, S18)
are ``unmanaged.py``'s, ``offload_to_cpu`` (S5, S7) ``offload.py``'s.

Rules (the kinds themselves are in ``kinds.py``'s Note):
* S6 mesh: an FSDP1 model built with ``device_mesh`` saves SHARDED parameters as ``DTensor`` s
  placed ``(Shard(0),)`` on that mesh, holding the same rows a ShardedTensor would, and loads them
  back; LOCAL with a mesh is refused on save and on load with upstream's RuntimeError.
* S1/S14 prefixes: ``state_dict(prefix=...)`` and a plain parent put every entry under the prefix
  and a dict saved that way loads back.
* S17 use_orig_params=True: FULL / SHARDED keys and values are those of use_orig_params=False.
* load errors: a LOCAL dict without a unit's ``_flat_param`` or with plain tensors, a SHARDED dict
  with a mis-shaped parameter or (strict) a missing one, is refused on every rank with a message
  that names what is wrong (upstream's words or the implementation's own, both accepted: the
  patterns below are what either says).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.sd_models import (
    AREA,
    Net,
    assert_clean_keys,
    assert_entry,
    assert_loaded,
    broadcast_from_rank0,
    build,
    expected_state_dict,
    fill_,
    first_error_everywhere,
    full_params,
    is_full_kind,
    plain_reference,
    require_kind,
    train,
)
from conformance.registry import check

MESH_LOCAL_MESSAGE = (
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
    "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
)


def _raises_everywhere(ctx, fn) -> Exception | None:
    """Run ``fn`` on every rank; return its exception (None if it returned)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the caller
        return exc
    return None


def _all_ranks(ctx, flag: bool) -> list[bool]:
    flags = [flag] * ctx.world_size
    if ctx.world_size > 1:
        torch.distributed.all_gather_object(flags, flag)
    return flags


# ----------------------------------------------------------------------------- device mesh
@check(area=AREA, requires={base.SHARDED_STATE_DICT, base.FLAT_PARAM}, min_world_size=2)
def mesh_sharded_dtensor(ctx):
    """S6: with ``device_mesh`` the SHARDED dict holds each parameter as a DTensor ``(Shard(0),)``
    on that mesh whose local rows are [r*ceil(d0/ws), ...) (none past the last chunk); buffers stay
    plain; the dict loads into a fresh mesh model."""
    from torch.distributed.tensor import DTensor

    model = build(ctx, mesh=ctx.mesh)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "sharded"))
    expected = plain_reference(Net, 0)
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), f"{ctx.where()} keys {sorted(sd)} != {sorted(expected)}"
    params = {n for n, _ in Net().named_parameters()}
    for name, exp in expected.items():
        if name in params:
            assert isinstance(sd[name], DTensor), (
                f"{ctx.where()} {name}: {type(sd[name]).__name__}, expected a DTensor (FSDP built "
                "with device_mesh)"
            )
            assert sd[name].device_mesh == ctx.mesh, (
                f"{ctx.where()} {name}: DTensor on another mesh"
            )
        assert_entry(ctx, name, sd[name], exp, full=name not in params)
    dst = build(ctx, salt=1, mesh=ctx.mesh)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, "sharded"))
    assert_loaded(ctx, dst, expected, "after loading a DTensor SHARDED dict")


@check(area=AREA, requires={base.LOCAL_STATE_DICT, base.FLAT_PARAM}, min_world_size=2)
def mesh_local_rejected(ctx):
    """S6: LOCAL_STATE_DICT on an FSDP model built with ``device_mesh`` raises RuntimeError("Found
    state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible ...") on save and on load, on
    every rank."""
    model = build(ctx, mesh=ctx.mesh)
    local_sd = ctx.impl.state_dict(build(ctx), "local")
    for what, fn in (
        ("save", lambda: ctx.impl.state_dict(model, "local")),
        ("load", lambda: ctx.impl.load_state_dict(model, local_sd, "local")),
    ):
        exc = _raises_everywhere(ctx, fn)
        flags = _all_ranks(ctx, exc is not None)
        assert all(flags), (
            f"{ctx.where()} LOCAL {what} with a device_mesh raised on ranks {flags}, expected all"
        )
        assert isinstance(exc, RuntimeError) and str(exc) == MESH_LOCAL_MESSAGE, (
            f"{ctx.where()} LOCAL {what} with a device_mesh: {type(exc).__name__}({str(exc)!r}), "
            f"expected RuntimeError({MESH_LOCAL_MESSAGE!r})"
        )


# ------------------------------------------------------------------ entries FSDP does not manage
class NonFsdpRoot(nn.Module):
    """A plain root: ``plain`` Linear(2, 3) (never sharded) next to ``fsdp``, a sharded ``Net``."""

    def __init__(self, ctx, salt: int = 0):
        super().__init__()
        self.plain = nn.Linear(2, 3).to(ctx.device)
        with torch.no_grad():
            self.plain.weight.copy_(torch.arange(6.0).reshape(3, 2) / 10 + salt)
            self.plain.bias.copy_(torch.arange(3.0) / 10 - salt)
        self.fsdp = build(ctx, salt=salt)

    @staticmethod
    def expected(salt: int = 0) -> dict:
        out = {f"fsdp.{k}": v for k, v in plain_reference(Net, salt).items()}
        out["plain.weight"] = torch.arange(6.0).reshape(3, 2) / 10 + salt
        out["plain.bias"] = torch.arange(3.0) / 10 - salt
        return out


# --------------------------------------------------------------------------------- offload
def _local_tensors(value) -> list[torch.Tensor]:
    if hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value]


# ------------------------------------------------------------------------------ load errors
def _drop_flat_param(ctx, sd):
    sd.pop("inner._flat_param")


def _plain_flat_params(ctx, sd):
    for key, value in list(sd.items()):
        if hasattr(value, "local_shards"):
            sd[key] = torch.zeros(value.size(), device=ctx.device)


def _wrong_shape(ctx, sd):
    sd["outer.weight"] = sd["inner.weight"]  # a (4, 4) ShardedTensor where (5, 4) belongs


def _drop_param(ctx, sd):
    sd.pop("inner.bias")


# case -> (kind, corruption, patterns every message must match, case-insensitive)
# R74: for these cases, a unit holding this parameter (one loaded after the offending unit in
# module order) must keep the fresh model's values: the refusal stops the load there.
UNTOUCHED_AFTER_REFUSAL = {"local-no-flat-param": "scale.weight"}
LOAD_ERRORS = {
    "local-no-flat-param": ("local", _drop_flat_param, [r"flat_?param"]),
    "local-plain-tensors": ("local", _plain_flat_params, [r"ShardedTensor"]),
    "sharded-wrong-shape": ("sharded", _wrong_shape, [r"outer\.weight", r"5, 4", r"4, 4"]),
    "sharded-missing-key": ("sharded", _drop_param, [r"missing", r"inner\.bias"]),
}


@check(
    area=AREA,
    requires={base.FLAT_PARAM},
    cases={k: {"case": k} for k in LOAD_ERRORS},
    min_world_size=2,
)
def load_errors(ctx, case):
    """S5/S7: loading a LOCAL dict without a unit's ``_flat_param`` or with plain tensors, or a
    SHARDED dict with a mis-shaped or (strict) missing parameter raises on every rank, with a
    message naming the problem (the FlatParameter / ShardedTensor / the key and both shapes).
    R74: a LOCAL dict without ``inner._flat_param`` is refused no later than when the load
    reaches ``inner``: the ``scale`` unit, loaded after it, keeps the fresh model's values."""
    kind, corrupt, patterns = LOAD_ERRORS[case]
    require_kind(ctx, kind)
    sd = dict(ctx.impl.state_dict(build(ctx), kind))
    corrupt(ctx, sd)
    dst = build(ctx, salt=1)
    watched = UNTOUCHED_AFTER_REFUSAL.get(case)
    before = [flat.clone() for fqns, flat in ctx.impl.flat_shards(dst) if watched in fqns]
    exc = _raises_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    flags = _all_ranks(ctx, exc is not None)
    assert all(flags), f"{ctx.where()} {case}: the load raised on ranks {flags}, expected all"
    missing = [p for p in patterns if not re.search(p, str(exc), re.IGNORECASE)]
    assert not missing, (
        f"{ctx.where()} {case}: message {type(exc).__name__}({str(exc)!r}) does not say "
        f"{missing} (it should name what is wrong)"
    )
    if watched is not None:
        after = [flat for fqns, flat in ctx.impl.flat_shards(dst) if watched in fqns]
        kept = _all_ranks(ctx, len(after) == len(before) == 1 and torch.equal(after[0], before[0]))
        assert all(kept), (
            f"{ctx.where()} {case}: the unit holding {watched} (loaded after the unit whose "
            f"flat parameter is missing) changed on ranks {[r for r, k in enumerate(kept) if not k]} although the "
            f"load was refused with {type(exc).__name__}({str(exc)!r}): the refusal must stop "
            "the load at the offending unit (R74)"
        )


# ------------------------------------------------------------------------ zero-numel parameter
class WithEmpty(nn.Module):
    """Linear(4, 4) next to a zero-numel (0,) parameter ``empty``, sharded as one unit."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0))
        fill_(self, salt)


@check(area=AREA, requires={base.FLAT_PARAM})
def zero_numel_param_round_trip(ctx):
    """S5: a unit holding a zero-numel (0,) parameter next to a Linear saves a SHARDED dict with
    every parameter (``empty`` as a (0,) entry, the Linear's rows chunked) that loads into a fresh
    model and restores the Linear's values. (Found by the fuzz area: torch 2.13's FSDP1 load
    raises ZeroDivisionError in _sharded_pre_load_state_dict_hook.)"""
    require_kind(ctx, "sharded")
    model = build(ctx, WithEmpty, plan=None)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "sharded"))
    expected = plain_reference(WithEmpty, 0)
    assert_clean_keys(ctx, sd)
    assert set(sd) == set(expected), (
        f"{ctx.where()} SHARDED keys {sorted(sd)}, expected {sorted(expected)}"
    )
    for name, exp in expected.items():
        assert_entry(ctx, name, sd[name], exp, full=is_full_kind(ctx, "sharded"))
    dst = build(ctx, WithEmpty, salt=1, plan=None)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, "sharded"))
    assert_loaded(ctx, dst, expected, "after loading a SHARDED dict with a zero-numel parameter")


class _Hole(nn.Module):
    """A module whose only parameter has numel 0."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(0))


class WithEmptyUnit(nn.Module):
    """``hole`` (its only parameter has numel 0), a unit of its own, next to Linear(4, 4)."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.hole = _Hole()
        self.lin = nn.Linear(4, 4)
        fill_(self, salt)


@check(area=AREA, requires={base.LOCAL_STATE_DICT, base.FLAT_PARAM}, min_world_size=2)
def local_empty_unit_round_trip(ctx):
    """S6: a unit whose flat parameter has no elements (its one parameter has numel 0) saves a
    LOCAL dict whose ``hole._flat_param`` is a ShardedTensor of size (0,) (the root's is one of
    the Linear's 20 elements), and the dict loads into a fresh model restoring the Linear. (Found
    by the fuzz area's ``local`` case on the reference; torch 2.13's FSDP1 cannot wrap such a
    unit. At world size 1 a LOCAL dict is a FULL one, S8.)"""
    require_kind(ctx, "local")
    plan = [("hole", {}), ("", {})]
    model = build(ctx, WithEmptyUnit, plan=plan)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "local"))
    flat = {k: v for k, v in sd.items() if k.endswith("_flat_param")}
    want = {"hole._flat_param": 0, "_flat_param": 20}
    got = {k: tuple(v.size()) for k, v in flat.items()}
    assert got == {k: (n,) for k, n in want.items()}, (
        f"{ctx.where()} LOCAL flat parameters {got}, expected {want} as 1-D sizes"
    )
    dst = build(ctx, WithEmptyUnit, salt=1, plan=plan)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, "local"))
    assert_loaded(
        ctx, dst, plain_reference(WithEmptyUnit, 0), "after loading a LOCAL dict with an empty unit"
    )


# --------------------------------------------------------------------------- use_orig_params
ORIG_PARAMS_CASES = {
    "full": {"kind": "full", "config": {}},
    "full-rank0_only": {"kind": "full", "config": {"rank0_only": True}},
    "sharded": {"kind": "sharded", "config": {}},
}


@check(area=AREA, requires={base.FLAT_PARAM, base.TRAINING}, cases=ORIG_PARAMS_CASES)
def orig_params_values(ctx, kind, config):
    """S17: with ``use_orig_params=True``, after two training steps the FULL / SHARDED dict has
    the keys of ``use_orig_params=False`` (the unwrapped model's) and the values of the unwrapped
    model trained on the global batch; with rank0_only the other ranks get {}; it loads back."""
    require_kind(ctx, kind)
    ref = Net()
    train(ref, ctx, local=True)
    expected = expected_state_dict(ref)
    model = build(ctx, use_orig_params=True)
    train(model, ctx)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind, **config))
    flat_keys = set(ctx.impl.state_dict(build(ctx), kind))  # collective: on every rank
    if config.get("rank0_only") and ctx.rank != 0:
        assert sd == {}, (
            f"{ctx.where()} rank0_only: expected {{}} on this rank, got keys {sorted(sd)[:6]}"
        )
    else:
        assert_clean_keys(ctx, sd)
        assert set(sd) == flat_keys == set(expected), (
            f"{ctx.where()} use_orig_params {kind} keys {sorted(sd)}; use_orig_params=False "
            f"{sorted(flat_keys)}; unwrapped {sorted(expected)}"
        )
        params = {n for n, _ in Net().named_parameters()}
        for name, exp in expected.items():
            assert_entry(
                ctx,
                name,
                sd[name],
                exp,
                full=name not in params or is_full_kind(ctx, kind),
                exact=False,
            )
    if config.get("rank0_only"):
        sd = broadcast_from_rank0(ctx, sd)
    dst = build(ctx, salt=1, use_orig_params=True)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    got = full_params(ctx, dst)
    for name, value in got.items():
        assert torch.allclose(value, expected[name], rtol=1e-4, atol=1e-5), (
            f"{ctx.where()} after loading the {kind} dict with use_orig_params: {name} differs"
        )


# ---------------------------------------------------------------------------------- prefixes
PREFIX_CASES = {k: {"kind": k} for k in ("full", "sharded", "local")}
_TYPE_NAME = {
    "full": "FULL_STATE_DICT",
    "sharded": "SHARDED_STATE_DICT",
    "local": "LOCAL_STATE_DICT",
}


@check(area=AREA, requires={base.FSDP1_API}, cases=PREFIX_CASES)
def prefixed_keys(ctx, kind):
    """S1/S14: ``state_dict(prefix="foo.")`` gives the unprefixed dict's entries under "foo."; a
    plain root holding the FSDP model under ``fsdp`` saves every entry under "fsdp." and that dict
    loads into a fresh plain root (the hooks strip and re-add the prefix)."""
    require_kind(ctx, kind)
    ns = ctx.impl.ns
    model = build(ctx)
    plain = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    with ns.FullyShardedDataParallel.state_dict_type(
        model, getattr(ns.StateDictType, _TYPE_NAME[kind])
    ):
        prefixed = first_error_everywhere(ctx, lambda: model.state_dict(prefix="foo."))
    want = {f"foo.{k}" for k in plain}
    assert set(prefixed) == want, (
        f"{ctx.where()} {kind} state_dict(prefix='foo.') keys: extra {sorted(set(prefixed) - want)}, "
        f"missing {sorted(want - set(prefixed))}"
    )
    for key, value in plain.items():
        for a, b in zip(_local_tensors(prefixed[f"foo.{key}"]), _local_tensors(value)):
            assert torch.equal(a.cpu(), b.cpu()), f"{ctx.where()} {kind} foo.{key}: value differs"

    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(NonFsdpRoot(ctx), kind))
    want = {f"fsdp.{k}" for k in plain} | {"plain.weight", "plain.bias"}
    assert set(sd) == want, (
        f"{ctx.where()} {kind} keys under a plain root: extra {sorted(set(sd) - want)}, missing "
        f"{sorted(want - set(sd))}"
    )
    dst = NonFsdpRoot(ctx, salt=1)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(dst, sd, kind))
    expected = NonFsdpRoot.expected()
    assert_loaded(
        ctx, dst.fsdp, plain_reference(Net, 0), f"after loading a {kind} dict under 'fsdp.'"
    )
    for name in ("plain.weight", "plain.bias"):
        got = dst.get_parameter(name).detach().cpu()
        assert torch.equal(got, expected[name]), f"{ctx.where()} {name} after load: {got.tolist()}"
