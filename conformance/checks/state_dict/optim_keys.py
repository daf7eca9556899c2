"""Area "state_dict": how FSDP1's optimizer-state APIs key the optimizer's state (S40-S45). The
older APIs given ``optim_input=`` (S39) are ``optim_input.py``'s.

[Note: the keys of an optimizer state dict]
A plain ``torch.optim`` optimizer keys its ``state_dict()`` by the index of each parameter in
its param groups (0, 1, ... across the groups in order). FSDP1's APIs translate that to the
original parameters' FQNs (S24) and back, and accept other ways of saying which index is which
(``optim_input=``, S39, in ``optim_input.py``):
* a dict keyed by parameter names (what a named optimizer, e.g. ``_NamedOptimizer``, saves): the
  state and the groups' ``params`` name each parameter by its name in the wrapped model's
  ``named_parameters()``. ``optim_state_dict(model, optim, optim_state_dict=<named dict>)`` gives
  the same FQN-keyed dict as the optimizer's own, and ``optim_state_dict_to_load(...,
  is_named_optimizer=True)`` gives back a dict keyed by those names.
* a state entry not tied to a parameter (``optim.state["note"] = tensor``, which
  ``Optimizer.state_dict()`` keeps under its own key) passes through both ways unchanged (also to
  every rank under FULL ``rank0_only``, where only rank 0 passes the dict).
* an optimizer without state yet (before its first step) gives ``{"state": {}}`` with the groups
  listing the FQNs.
* every rank's optimizer must hold the state of every flat parameter rank 0's holds: if one does
  not (``use_orig_params=False``), ``optim_state_dict`` raises RuntimeError on every rank naming
  each rank that lacks state and the FQNs it lacks, and no other rank.
* with ``use_orig_params=True`` a module FSDP ignores keeps its plain state (as S31 for flat
  parameters), moved to the CPU under FULL's default ``offload_to_cpu=True``; its non-tensor
  entries stay as they are. An optimizer holding only part of a unit's trainable parameters is refused (RuntimeError
  naming the parameter it lacks).
* on a model built with ``device_mesh`` the SHARDED form holds DTensors ``(Shard(0),)`` on that
  mesh instead of ShardedTensors (as S6 for the model), and LOCAL is refused.
* a FULL dict whose parameters of one flat parameter disagree on a state entry (shape, dtype,
  non-tensor value, type) cannot be flattened and is refused with ValueError; an entry that is
  None for all of them stays None.
"""

from __future__ import annotations

import copy
import warnings

import torch

from conformance.adapters import base
from conformance.checks._shared.optim_state import STATE_TOL
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.checks.state_dict.optim_groups import (
    PLAN,
    REQUIRES,
    STEPS,
    CountingAdam,
    _assert_osd,
    _build,
    _context,
    _groups,
    _load_and_step,
    _osd,
    _step,
    _trained,
)
from conformance.registry import check

# a state entry not tied to any parameter; 0-dim under FULL rank0_only (S41: torch 2.13 leaves the
# other ranks a placeholder for a positive-dim one there)
NOTE = torch.tensor([3.0, -1.5])
SCALAR_NOTE = torch.tensor(2.5)


def _assert_steps_like(ctx, oracle, oopt, models, what):
    """One more step of the oracle and of each (model, optimizer, sharded) gives equal params."""
    _step(ctx, oracle, oopt, STEPS)
    for model, opt, sharded in models:
        _step(ctx, model, opt, STEPS)
        got = full_params(ctx, model) if sharded else dict(model.named_parameters())
        kind = "sharded" if sharded else "unsharded"
        for name, ref in oracle.named_parameters():
            label = f"{name} of the {kind} model one step after {what}"
            assert_close(ctx, label, got[name], ref, FP32["param"])


def _names_in_order(model, opt):
    """The name in ``model.named_parameters()`` of each parameter of ``opt``, in index order."""
    name_of = {p: n for n, p in model.named_parameters()}
    return [name_of[p] for g in opt.param_groups for p in g["params"]]


def _to_names(sd, order):
    """``sd`` (keyed by index) keyed by name; keys that are not indices stay."""
    state = {(order[k] if isinstance(k, int) else k): v for k, v in sd["state"].items()}
    groups = [dict(g, params=[order[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _to_indices(sd, order):
    index = {n: i for i, n in enumerate(order)}
    state = {index.get(k, k): v for k, v in sd["state"].items()}
    groups = [dict(g, params=sorted(index[n] for n in g["params"])) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


NAMED_CASES = {
    "full": {"kind": "full", "orig_params": False, "named": True},
    "full-by_index": {"kind": "full", "orig_params": False, "named": False},
    "sharded-orig_params": {"kind": "sharded", "orig_params": True, "named": True},
    "full-rank0_only-orig_params": {
        "kind": "full",
        "orig_params": True,
        "named": True,
        "rank0_only": True,
    },
}


@check(area=AREA, requires=REQUIRES, cases=NAMED_CASES, world_sizes=(2,))
def fsdp1_optim_named_and_user_state(ctx, kind, orig_params, named, rank0_only=False):
    """S40/S41: before any step ``optim_state_dict`` gives no state and groups listing the FQNs;
    after two steps, given the optimizer's state dict keyed by the wrapped model's parameter names
    (``optim_state_dict=``) or by index, with a state entry ``note`` tied to no parameter, it gives
    the unsharded optimizer's FQN-keyed state plus ``note`` unchanged (with a warning naming it);
    ``optim_state_dict_to_load(..., is_named_optimizer=)`` gives a dict keyed the same way that
    loads into a fresh model's optimizer (``note`` on every rank, also under ``rank0_only``) and
    one more step gives the unsharded model's parameters."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    count = not rank0_only  # see optim_groups' [Note: rank0_only and non-tensor state]
    oracle, model = _build(ctx, "plain", orig_params)
    oopt = CountingAdam(_groups(oracle.named_parameters()), count)
    opt = CountingAdam(_groups(model.named_parameters()), count)
    offload = False if kind == "full" else None  # optim_groups' [Note: CPU offload aliasing]
    if not rank0_only:
        empty = _osd(ctx, model, opt, kind, offload=offload)
        fqns = [
            sorted(n for n, _ in oracle.named_parameters() if ("inner" in n) == first)
            for first in (True, False)
        ]
        assert (
            empty.get("state") == {}
            and [sorted(g["params"]) for g in empty["param_groups"]] == fqns
        ), f"{ctx.where()} before any step: {empty!r:.200}, expected no state and the groups {fqns}"
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    note_value = SCALAR_NOTE if rank0_only else NOTE
    opt.state["note"] = note_value.clone()
    order = _names_in_order(model, opt)
    given = _to_names(opt.state_dict(), order) if named else opt.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _context(ctx, model, kind, rank0_only, offload):
            osd = fsdp.optim_state_dict(model, opt, optim_state_dict=given)
    what = f"optim_state_dict ({'named' if named else 'by index'}, {kind})"
    if rank0_only and ctx.rank != 0:
        assert not osd, f"{ctx.where()} rank0_only: expected {{}}, got keys {sorted(osd)}"
    else:
        said = [str(w.message) for w in caught if "note" in str(w.message)]
        assert said, (
            f"{ctx.where()} {what}: no warning named the state entry 'note' that maps to no "
            f"parameter; warnings: {[str(w.message)[:80] for w in caught]}"
        )
        note = osd["state"].pop("note", None)
        assert torch.is_tensor(note) and torch.equal(note, note_value), (
            f"{ctx.where()} {what}: state entry 'note' {note!r}, expected {note_value} unchanged"
        )
        _assert_osd(ctx, osd, oracle, oopt, kind == "full", what)
        osd["state"]["note"] = note

    msd = ctx.impl.state_dict(model, "full")
    _, fresh = _build(ctx, "plain", orig_params)
    ctx.impl.load_state_dict(fresh, msd, "full")
    fopt = CountingAdam(_groups(fresh.named_parameters()), count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, fresh, kind, rank0_only):
            flat = fsdp.optim_state_dict_to_load(fresh, fopt, osd, is_named_optimizer=named)
    forder = _names_in_order(fresh, fopt)
    if named:
        keys = sorted(k for k in flat["state"] if k != "note")
        listed = sorted(n for g in flat["param_groups"] for n in g["params"])
        assert keys and set(keys) <= set(forder) and listed == sorted(forder), (
            f"{ctx.where()} is_named_optimizer=True: state keys {keys}, groups {listed}, expected "
            f"names of the wrapped model's parameters {forder}"
        )
        flat = _to_indices(flat, forder)
    fopt.load_state_dict(flat)
    note = fopt.state.get("note")
    assert torch.is_tensor(note) and torch.equal(note.cpu(), note_value), (
        f"{ctx.where()} after the load: state entry 'note' {note!r}, expected {note_value}"
    )
    del fopt.state["note"]
    back = _osd(ctx, fresh, fopt, "full", offload=False)
    _assert_osd(ctx, back, oracle, oopt, True, f"after the {kind} load")
    _assert_steps_like(ctx, oracle, oopt, [(fresh, fopt, True)], f"the {kind} load")


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_missing_on_rank(ctx):
    """S42: with ``use_orig_params=False``, when rank 1's optimizer holds only ``inner``'s flat
    parameter while rank 0's holds the root unit's too, ``optim_state_dict`` (FULL) raises
    RuntimeError on every rank, naming rank 1 and the root unit's FQNs (``head.weight``,
    ``head.bias``) it lacks, and no other rank."""
    ctx.seed(0)
    model = ctx.impl.shard(InnerHeadNet().to(ctx.device), ctx, plan=PLAN)
    named = list(model.named_parameters())
    params = [p for n, p in named if ctx.rank == 0 or "inner" in ctx.impl.clean_fqn(n)]
    assert len(params) < len(named) or ctx.rank == 0, f"{ctx.where()} setup: nothing left out"
    opt = torch.optim.Adam(params, lr=1e-2)
    _step(ctx, model, opt, 0)
    try:
        _osd(ctx, model, opt, "full", offload=False)
    except RuntimeError as exc:
        msg = str(exc)
        lines = [line for line in msg.splitlines() if line.lstrip().startswith("Rank ")]
        assert len(lines) == 1 and "Rank 1" in lines[0], (
            f"{ctx.where()} RuntimeError {msg[:300]!r}: expected one line naming rank 1 (only "
            "rank 1 lacks state)"
        )
        assert "head.weight" in lines[0] and "head.bias" in lines[0] and "inner" not in lines[0], (
            f"{ctx.where()} RuntimeError line {lines[0]!r}: expected it to name head.weight and "
            "head.bias (the root unit's parameters) and nothing of inner"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict returned although rank 1's optimizer lacks the root "
            "unit's state; expected RuntimeError"
        )


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"orig_params": {"orig_params": True}, "flat": {"orig_params": False}},
    world_sizes=(1, 2),  # ws 1: the unsharded path of use_orig_params's gather
)
def fsdp1_optim_orig_params_ignored(ctx, orig_params):
    """S43/S31: with ``use_orig_params`` True (and False) and ``ignored_modules=[side]``,
    ``optim_state_dict`` gives ``side``'s parameters their plain state (``step``, moments, the
    int ``seen``) equal to the unsharded optimizer's, on the CPU under FULL's default
    ``offload_to_cpu=True``; with ``offload_to_cpu=False`` the whole dict is the unsharded
    optimizer's and it loads into a fresh model: one more step gives the unsharded model's
    parameters."""
    oracle, oopt, model, opt = _trained(ctx, "ignored", orig_params)
    osd = _osd(ctx, model, opt, "full")  # offload_to_cpu=True, the default
    for name, param in oracle.side.named_parameters():
        mine, want = osd["state"].get(f"side.{name}"), oopt.state[param]
        assert mine is not None and sorted(mine) == sorted(want), (
            f"{ctx.where()} side.{name} (ignored): state {mine!r:.120}, expected the names "
            f"{sorted(want)}"
        )
        assert mine["seen"] == want["seen"] and not torch.is_tensor(mine["seen"]), (
            f"{ctx.where()} side.{name}: seen {mine['seen']!r}, expected {want['seen']!r}"
        )
        for key, value in mine.items():
            if torch.is_tensor(value):
                assert value.device.type == "cpu", (
                    f"{ctx.where()} side.{name}.{key} on {value.device} with "
                    "offload_to_cpu=True, expected the CPU"
                )
                tol = STATE_TOL.get(key, dict(rtol=0, atol=0))  # step: exact
                assert_close(ctx, f"side.{name}.{key}", value, want[key], tol)
    osd = _osd(ctx, model, opt, "full", offload=False)
    _assert_osd(ctx, osd, oracle, oopt, True, "optim_state_dict (full, offload_to_cpu=False)")
    _load_and_step(ctx, oracle, oopt, model, osd, "full", False, "ignored", orig_params)


def _dtensor_entries(ctx, osd, what):
    """``osd`` with each DTensor state entry replaced by its full tensor, after checking it is
    ``(Shard(0),)`` on ``ctx.mesh`` holding this rank's ``torch.chunk`` rows."""
    from torch.distributed.tensor import DTensor, Shard

    full = {"state": {}, "param_groups": osd["param_groups"]}
    for name, entry in osd["state"].items():
        full["state"][name] = dict(entry)
        for key, value in entry.items():
            if not (torch.is_tensor(value) and value.dim() > 0):
                continue
            assert isinstance(value, DTensor), (
                f"{ctx.where()} {what} {name}.{key}: {type(value).__name__}, expected a DTensor "
                "(FSDP built with device_mesh)"
            )
            assert value.device_mesh == ctx.mesh and tuple(value.placements) == (Shard(0),), (
                f"{ctx.where()} {what} {name}.{key}: placements {value.placements}, expected "
                "(Shard(0),) on the model's mesh"
            )
            whole = value.full_tensor()
            expected = chunk_of(whole, 0, ctx.world_size, ctx.rank)
            assert torch.equal(value.to_local(), expected), (
                f"{ctx.where()} {what} {name}.{key}: local rows differ from this rank's chunk"
            )
            full["state"][name][key] = whole
    return full


@check(
    area=AREA,
    requires=REQUIRES | {base.SHARDED_STATE_DICT},
    cases={"flat": {"orig_params": False}, "orig_params": {"orig_params": True}},
    world_sizes=(2,),
)
def fsdp1_optim_mesh_dtensor(ctx, orig_params):
    """S44: on an FSDP1 model built with ``device_mesh``, ``optim_state_dict`` under SHARDED gives
    each moment as a DTensor ``(Shard(0),)`` on that mesh holding this rank's ``torch.chunk`` rows,
    whose full tensors are the unsharded optimizer's state; it loads into a fresh mesh model
    through ``optim_state_dict_to_load`` and one more step gives the unsharded model's
    parameters; under LOCAL ``optim_state_dict`` raises RuntimeError naming LOCAL_STATE_DICT."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)

    def build():
        return ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=PLAN, use_orig_params=orig_params, mesh=ctx.mesh
        )

    model = build()
    oopt = CountingAdam(_groups(oracle.named_parameters()))
    opt = CountingAdam(_groups(model.named_parameters()))
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = _osd(ctx, model, opt, "sharded")
    what = "optim_state_dict (SHARDED, device_mesh)"
    _assert_osd(ctx, _dtensor_entries(ctx, osd, what), oracle, oopt, True, what)
    try:
        _osd(ctx, model, opt, "local")
    except RuntimeError as exc:
        assert "LOCAL_STATE_DICT" in str(exc), (
            f"{ctx.where()} LOCAL with device_mesh: RuntimeError {str(exc)[:160]!r}, expected it "
            "to name LOCAL_STATE_DICT"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict under LOCAL on a device_mesh model returned; "
            "expected RuntimeError"
        )

    msd = ctx.impl.state_dict(model, "full")
    fresh = build()
    ctx.impl.load_state_dict(fresh, msd, "full")
    fopt = CountingAdam(_groups(fresh.named_parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, fresh, "sharded"):
            flat = fsdp.optim_state_dict_to_load(fresh, fopt, osd)
    fopt.load_state_dict(flat)
    back = _osd(ctx, fresh, fopt, "full", offload=False)
    _assert_osd(ctx, back, oracle, oopt, True, "after the SHARDED load (device_mesh)")
    _assert_steps_like(ctx, oracle, oopt, [(fresh, fopt, True)], "the SHARDED load (device_mesh)")


def _corrupt(osd, how):
    """A copy of the FULL dict ``osd`` with ``inner.bias``'s entry (same flat parameter as
    ``inner.weight``) made inconsistent: ``how`` names the way."""
    bad = {
        "state": {k: dict(v) for k, v in osd["state"].items()},
        "param_groups": osd["param_groups"],
    }
    entry = bad["state"]["inner.bias"]
    if how == "shape":
        entry["exp_avg"] = entry["exp_avg"].reshape(1, -1)
    elif how == "dtype":
        entry["exp_avg"] = entry["exp_avg"].double()
    elif how == "value":
        entry["seen"] = entry["seen"] + 1
    else:  # "type": an int where the unit's other parameter has a tensor
        entry["exp_avg"] = 1
    return bad


REFUSALS = (  # how, the words of the ValueError
    ("shape", "same shape as its parameter"),
    ("dtype", "same dtype"),
    ("value", "same value"),
    ("type", "Differing optimizer state types"),
)


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_load_inconsistent_unit(ctx):
    """S45: ``optim_state_dict_to_load`` under FULL (``use_orig_params=False``) refuses with
    ValueError a dict in which ``inner.bias`` disagrees with ``inner.weight`` (one flat parameter)
    or with its parameter: a moment of another shape ("same shape as its parameter"), of another
    dtype ("same dtype"), a non-tensor entry of another value ("same value"), an entry of another
    type ("Differing optimizer state types"); a dict without ``"state"`` with ValueError naming
    it; an entry that is None for every parameter loads and ``optim_state_dict`` gives it back as
    None per parameter."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    oracle, oopt, model, opt = _trained(ctx)
    osd = _osd(ctx, model, opt, "full", offload=False)
    for how, words in REFUSALS:
        fopt = CountingAdam(_groups(model.named_parameters()))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with _context(ctx, model, "full"):
                    fsdp.optim_state_dict_to_load(model, fopt, _corrupt(osd, how))
        except ValueError as exc:
            assert words in str(exc), (
                f"{ctx.where()} inner.bias of another {how}: ValueError {str(exc)[:200]!r}, "
                f"expected it to say {words!r}"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} optim_state_dict_to_load accepted inner.bias with a state entry "
                f"of another {how} than inner.weight's; expected ValueError"
            )
    fopt = CountingAdam(_groups(model.named_parameters()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _context(ctx, model, "full"):
                fsdp.optim_state_dict_to_load(model, fopt, {"param_groups": osd["param_groups"]})
    except ValueError as exc:
        assert '"state"' in str(exc), (
            f"{ctx.where()} a dict without 'state': ValueError {str(exc)[:160]!r}, expected it to "
            'name the key "state"'
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict_to_load accepted a dict without 'state'; expected "
            "ValueError"
        )
    for entry in osd["state"].values():
        entry["hint"] = None
    fopt = CountingAdam(_groups(model.named_parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _context(ctx, model, "full"):
            fopt.load_state_dict(fsdp.optim_state_dict_to_load(model, fopt, osd))
    back = _osd(ctx, model, fopt, "full", offload=False)
    for name, entry in back["state"].items():
        assert "hint" in entry and entry.pop("hint") is None, (
            f"{ctx.where()} {name}: state names {sorted(entry)} after loading 'hint': None for "
            "every parameter, expected 'hint' back as None"
        )
    _assert_osd(ctx, back, oracle, oopt, True, "after loading a dict with a None entry")


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_orig_params_partial_unit(ctx):
    """S43: with ``use_orig_params=True``, an optimizer that holds ``head.weight`` but not
    ``head.bias`` (trainable, same unit) makes ``optim_state_dict`` raise RuntimeError on every
    rank naming ``head.bias`` as not in the optimizer state."""
    ctx.seed(0)
    model = ctx.impl.shard(InnerHeadNet().to(ctx.device), ctx, plan=PLAN, use_orig_params=True)
    params = [p for n, p in model.named_parameters() if ctx.impl.clean_fqn(n) != "head.bias"]
    opt = torch.optim.Adam(params, lr=1e-2)
    _step(ctx, model, opt, 0)
    try:
        _osd(ctx, model, opt, "full", offload=False)
    except RuntimeError as exc:
        assert "head.bias" in str(exc) and "not in the optimizer state" in str(exc), (
            f"{ctx.where()} RuntimeError {str(exc)[:200]!r}: expected it to name head.bias as "
            "not in the optimizer state"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} optim_state_dict returned although the optimizer lacks head.bias of "
            "a unit whose head.weight it holds; expected RuntimeError"
        )
