"""Area "fsdp2_state_dict": the options of ``torch.distributed.checkpoint.state_dict``'s model
helpers on a ``fully_shard`` model, getting and loading (P27, P28).

[Note: which ranks get and give what]
Getting (``get_model_state_dict``), per ``StateDictOptions``:
* ``full_state_dict=True``: every rank gets plain full tensors (the unsharded model's values) on
  the compute device; with ``cpu_offload=True`` as well, only rank 0 gets them (on the CPU) and
  every other rank gets ``{}``.
* ``full_state_dict=False``: DTensors whose local tensor is this rank's chunk (P1); with
  ``cpu_offload=True`` the local tensors are on the CPU.
Loading (``set_model_state_dict`` / ``set_state_dict``): a full dict on every rank
(``full_state_dict=True``) leaves each rank with its own chunk of it; with
``broadcast_from_rank0=True`` only rank 0 passes the full dict and every other rank passes
``{}``, and every rank still ends with its chunk of rank 0's values, also when the sharded model
was built on the meta device (the load then materializes it) and with ``cpu_offload=True``.
``strict=False``: a key the dict lacks keeps the model's own value and an unexpected key is
reported on the rank that passed it (rank 0 under broadcast); ``strict=True`` refuses such a dict
with RuntimeError on every rank (under broadcast naming the lacking key as missing; without
broadcast the lacking key is filled from the model, so only the extra key is named). The helpers take the dict they are given as
scratch (they may replace its values), so every call here gets a fresh dict.

The oracle is the unsharded model with the target values: the expected chunks come from
``_shared/rows.py``, the expected forward output from the unsharded model itself.
"""

from __future__ import annotations

import copy
import re

import torch

from conformance.adapters import base
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.state_dict import PLAN, Net, batch
from conformance.registry import check

REQUIRES = {base.DCP_HELPERS, base.DTENSOR_PARAMS, base.FSDP2_API}
MISSING, EXTRA = "lin2.bias", "extra.weight"


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _sharded(ctx, salt=0, meta=False):
    if meta:
        with torch.device("meta"):
            model = Net(salt)
    else:
        model = Net(salt).to(ctx.device)
    return ctx.impl.shard(model, ctx, plan=PLAN)


def _plain(salt):
    return {k: v.detach().clone() for k, v in Net(salt).state_dict().items()}


def _assert_holds(ctx, model, expected: dict, what: str):
    """Every parameter's local tensor is this rank's chunk of ``expected`` (on the model's
    device, not meta), and the forward output is the unsharded model's with those values."""
    for fqn, param in model.named_parameters():
        local = param.to_local()
        assert local.device.type != "meta", f"{ctx.where()} {fqn} still on meta {what}"
        want = chunk_of(expected[fqn], 0, ctx.world_size, ctx.rank)
        assert torch.equal(local.detach().cpu(), want), (
            f"{ctx.where()} {fqn} {what}: local shard {local.detach().cpu().flatten()[:4].tolist()}"
            f"..., expected this rank's chunk of the loaded values "
            f"{want.flatten()[:4].tolist()}..."
        )
    oracle = Net(0)
    oracle.load_state_dict(expected)
    out = model(batch(ctx)).detach().cpu()
    ref = oracle.to(ctx.device)(batch(ctx)).detach().cpu()
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-7), (
        f"{ctx.where()} forward {what} differs from the unsharded model with the loaded values"
    )


GET_CASES = {
    "full": {"full": True, "cpu_offload": False},
    "full-cpu_offload": {"full": True, "cpu_offload": True},
    "sharded": {"full": False, "cpu_offload": False},
    "sharded-cpu_offload": {"full": False, "cpu_offload": True},
}


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=GET_CASES, world_sizes=(2,))
def dsd_get_options(ctx, full, cpu_offload):
    """P27: ``get_model_state_dict`` with ``full_state_dict`` gives every rank plain full tensors
    equal to the unsharded model's (with ``cpu_offload`` only rank 0, on the CPU; the others
    ``{}``); without it DTensors whose local tensors are this rank's chunks (on the CPU with
    ``cpu_offload``); keys are the unsharded model's."""
    from torch.distributed.tensor import DTensor

    dsd = _dsd()
    model, plain = _sharded(ctx, 1), _plain(1)
    opts = dsd.StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)
    sd = dsd.get_model_state_dict(model, options=opts)
    if full and cpu_offload and ctx.rank != 0:
        assert sd == {}, f"{ctx.where()} full + cpu_offload: expected {{}}, got keys {sorted(sd)}"
        return
    assert sorted(sd) == sorted(plain), f"{ctx.where()} keys {sorted(sd)}, expected {sorted(plain)}"
    device = "cpu" if cpu_offload else ctx.device.type
    for fqn, value in sd.items():
        if full:
            assert not isinstance(value, DTensor), (
                f"{ctx.where()} {fqn}: a DTensor in a full state dict, expected a plain tensor"
            )
            local, want = value, plain[fqn]
        else:
            assert isinstance(value, DTensor), (
                f"{ctx.where()} {fqn}: {type(value).__name__} in a sharded state dict, expected "
                "a DTensor"
            )
            local, want = value.to_local(), chunk_of(plain[fqn], 0, ctx.world_size, ctx.rank)
        assert local.device.type == device, (
            f"{ctx.where()} {fqn}: on {local.device}, expected {device} (cpu_offload={cpu_offload})"
        )
        assert torch.equal(local.detach().cpu(), want), (
            f"{ctx.where()} {fqn}: values differ from the unsharded model's"
            + ("" if full else " chunk for this rank")
        )


LOAD_CASES = {
    "full": {"broadcast": False, "cpu_offload": False, "meta": False},
    "full-cpu_offload": {"broadcast": False, "cpu_offload": True, "meta": False},
    "broadcast": {"broadcast": True, "cpu_offload": False, "meta": False},
    "broadcast-cpu_offload": {"broadcast": True, "cpu_offload": True, "meta": False},
    "broadcast-meta_model": {"broadcast": True, "cpu_offload": False, "meta": True},
}


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=LOAD_CASES, world_sizes=(2, 4))
def dsd_load_full(ctx, broadcast, cpu_offload, meta):
    """P28: ``set_model_state_dict`` with ``full_state_dict=True`` of another model's full values
    (every rank passing them, or with ``broadcast_from_rank0=True`` rank 0 only and the others
    ``{}``; with ``cpu_offload``; into a model sharded on the meta device) leaves every rank's
    shards equal to its chunks of those values, reports no missing or unexpected key, and the
    forward equals the unsharded model's with them."""
    dsd = _dsd()
    model, target = _sharded(ctx, 0, meta=meta), _plain(3)
    given = target if (ctx.rank == 0 or not broadcast) else {}
    opts = dsd.StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast, cpu_offload=cpu_offload
    )
    result = dsd.set_model_state_dict(model, copy.deepcopy(given), options=opts)
    assert not result.missing_keys and not result.unexpected_keys, (
        f"{ctx.where()} load result {result}, expected no missing or unexpected key"
    )
    _assert_holds(ctx, model, target, "after the full load")


@check(area="fsdp2_state_dict", requires=REQUIRES, world_sizes=(2, 4))
def dsd_load_sharded(ctx):
    """P28: ``set_model_state_dict`` of another sharded model's ``get_model_state_dict`` (DTensors,
    ``full_state_dict=False``) leaves this rank's shards equal to the chunks of that model's
    values and the forward equal to the unsharded model's with them."""
    dsd = _dsd()
    source, model, target = _sharded(ctx, 3), _sharded(ctx, 0), _plain(3)
    sd = dsd.get_model_state_dict(source)
    result = dsd.set_model_state_dict(model, sd)
    assert not result.missing_keys and not result.unexpected_keys, f"{ctx.where()} {result}"
    _assert_holds(ctx, model, target, "after the sharded load")


STRICT_CASES = {
    "full": {"broadcast": False},
    "broadcast": {"broadcast": True},
}


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=STRICT_CASES, world_sizes=(2,))
def dsd_load_strict_false(ctx, broadcast):
    """P28: a full dict without ``lin2.bias`` and with an extra ``extra.weight`` (given by every
    rank, or by rank 0 alone under ``broadcast_from_rank0``): with ``strict=False`` every other
    parameter takes the dict's values, ``lin2.bias`` keeps the model's own, and ``extra.weight``
    is reported unexpected by each rank that passed it, nothing missing; with ``strict=True`` the
    same dict is refused with RuntimeError on every rank, naming ``lin2.bias`` as missing under
    broadcast and ``extra.weight`` as unexpected without (the lacking key is filled from the
    model there)."""
    dsd = _dsd()

    def partial():
        if broadcast and ctx.rank != 0:
            return {}
        sd = {k: v for k, v in _plain(3).items() if k != MISSING}
        sd[EXTRA] = torch.ones(2, 2)
        return sd

    model = _sharded(ctx, 0)
    opts = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
    result = dsd.set_model_state_dict(model, partial(), options=opts)
    passed = ctx.rank == 0 or not broadcast
    assert list(result.unexpected_keys) == ([EXTRA] if passed else []), (
        f"{ctx.where()} strict=False: unexpected keys {result.unexpected_keys}, expected "
        f"{[EXTRA] if passed else []}"
    )
    assert not result.missing_keys, (
        f"{ctx.where()} strict=False: missing keys {result.missing_keys}; a full load keeps the "
        "model's own value for a key the dict lacks"
    )
    expected = _plain(3)
    expected[MISSING] = _plain(0)[MISSING]
    _assert_holds(ctx, model, expected, "after a strict=False load")

    model = _sharded(ctx, 0)
    opts = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    try:
        dsd.set_model_state_dict(model, partial(), options=opts)
    except RuntimeError as exc:
        # under broadcast the other ranks' dicts are built from the model's keys: the lacking
        # key is missing; without it the lacking key is filled from the model, the extra one stays
        named = (
            rf"Missing key\(s\).*{re.escape(MISSING)}"
            if broadcast
            else rf"Unexpected key\(s\).*{re.escape(EXTRA)}"
        )
        assert re.search(named, str(exc), re.S), (
            f"{ctx.where()} strict=True: message {str(exc)[:200]!r} does not match {named!r}"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} strict=True accepted a dict without {MISSING}; expected RuntimeError"
        )


@check(area="fsdp2_state_dict", requires=REQUIRES, world_sizes=(2,))
def dsd_get_ignore_frozen_params(ctx):
    """P27: with ``lin1.bias`` frozen (``requires_grad=False``), ``get_model_state_dict`` with
    ``ignore_frozen_params=True`` leaves it out and keeps every other key (values: this rank's
    chunks); without the option it is there."""
    dsd = _dsd()
    model = Net(1).to(ctx.device)
    model.lin1.bias.requires_grad_(False)
    model = ctx.impl.shard(model, ctx, plan=PLAN)
    plain = _plain(1)
    for ignore in (True, False):
        opts = dsd.StateDictOptions(ignore_frozen_params=ignore)
        sd = dsd.get_model_state_dict(model, options=opts)
        expected = sorted(k for k in plain if not (ignore and k == "lin1.bias"))
        assert sorted(sd) == expected, (
            f"{ctx.where()} ignore_frozen_params={ignore}: keys {sorted(sd)}, expected {expected}"
        )
        for fqn, value in sd.items():
            want = chunk_of(plain[fqn], 0, ctx.world_size, ctx.rank)
            assert torch.equal(value.to_local().detach().cpu(), want), (
                f"{ctx.where()} ignore_frozen_params={ignore} {fqn}: not this rank's chunk"
            )


@check(area="fsdp2_state_dict", requires=REQUIRES, world_sizes=(2,))
def dsd_get_submodules(ctx):
    """P27: ``get_model_state_dict(model, submodules={model.lin2})`` (deprecated, with a
    FutureWarning) holds only ``lin2``'s entries: under ``lin2.weight`` / ``lin2.bias`` with
    ``keep_submodule_prefixes=True`` (the default), under ``weight`` / ``bias`` with False;
    values are this rank's chunks of ``lin2``'s parameters."""
    import warnings

    dsd = _dsd()
    model, plain = _sharded(ctx, 1), _plain(1)
    for keep in (True, False):
        opts = dsd.StateDictOptions(keep_submodule_prefixes=keep)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            sd = dsd.get_model_state_dict(model, submodules={model.lin2}, options=opts)
        expected = {("lin2." if keep else "") + k: f"lin2.{k}" for k in ("weight", "bias")}
        assert sorted(sd) == sorted(expected), (
            f"{ctx.where()} submodules={{lin2}}, keep_submodule_prefixes={keep}: keys "
            f"{sorted(sd)}, expected {sorted(expected)}"
        )
        for key, fqn in expected.items():
            want = chunk_of(plain[fqn], 0, ctx.world_size, ctx.rank)
            assert torch.equal(sd[key].to_local().detach().cpu(), want), (
                f"{ctx.where()} submodules={{lin2}} {key}: not this rank's chunk of {fqn}"
            )
