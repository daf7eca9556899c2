"""Area "state_dict": what FSDP1's optimizer-state loading does besides the state (S50-S52).

[Note: the dict a caller passes in, and what the calls warn]
* ``optim_state_dict_to_load(model, optim, osd)`` reads ``osd``; it does not consume it. After
  the call the caller's dict holds what it held before (every state entry with its names and
  values, the param groups), under FULL, FULL ``rank0_only`` (rank 0's dict: the other ranks
  pass ``{}``) and SHARDED, so the same dict loads a second time and gives an equal result.
* ``optim_input=`` of the older APIs is deprecated: passing it gives one FutureWarning naming
  ``optim_input`` per call (``full_optim_state_dict``, ``shard_full_optim_state_dict``,
  ``rekey_optim_state_dict``); leaving it out gives none (each API still warns that it is
  deprecated itself, a different warning).
* ``optim_state_dict_to_load(..., is_named_optimizer=True)`` on a ``use_orig_params=True`` model
  returns state only for the parameters that hold elements on this rank. A parameter that holds
  none here (all its elements in another rank's chunk of the flat parameter) and has no state in
  this rank's optimizer gets no entry, and a UserWarning names it and the rank ("optim_state[...
  'inner.bias' ...] is not on rank0."). ``InnerHeadNet`` at world size 2: ``inner`` flattens 30
  elements (weight 24, then bias 6), rank 0 holds the first 15; the root's ``head`` 21 (weight
  18, bias 3), rank 0 the first 11 (or 12 with alignment padding): so rank 0 holds nothing of
  ``inner.bias`` and ``head.bias``, rank 1 something of every parameter.
"""

from __future__ import annotations

import warnings

import torch

from conformance.checks._shared.sd_models import AREA
from conformance.checks.state_dict.optim_groups import (
    REQUIRES,
    STEPS,
    _build,
    _context,
    _groups,
    _osd,
    _step,
    _trained,
)
from conformance.registry import check


def _snapshot(value):
    """A deep copy of an optimizer state dict, ShardedTensors as their local shards."""
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    if hasattr(value, "local_shards"):
        return ("sharded", [_snapshot(s.tensor) for s in value.local_shards()])
    if torch.is_tensor(value):
        return value.detach().clone()
    return value


def _diff(got, want, path="osd"):
    """The first place where two snapshots differ, or None."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(map(str, got)) != sorted(map(str, want)):
            keys = sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__
            return f"{path}: keys {keys}, expected {sorted(map(str, want))}"
        for k in want:
            found = _diff(got[k], want[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{path}: {got!r:.80}, expected {want!r:.80}"
        for i, (g, w) in enumerate(zip(got, want)):
            found = _diff(g, w, f"{path}[{i}]")
            if found:
                return found
        return None
    if torch.is_tensor(want):
        same = torch.is_tensor(got) and got.shape == want.shape and torch.equal(got.cpu(), want)
        return None if same else f"{path}: {got!r:.80}, expected {want!r:.80}"
    return None if got == want else f"{path}: {got!r:.80}, expected {want!r:.80}"


FORMS = (("full", False), ("full", True), ("sharded", False))


@check(area=AREA, requires=REQUIRES, world_sizes=(1, 2))
def fsdp1_optim_load_keeps_input(ctx):
    """S50: ``optim_state_dict_to_load`` leaves the dict it is given as it was (state names and
    values, param groups) under FULL, FULL ``rank0_only`` (rank 0's dict) and SHARDED, and
    loading the same dict again gives an equal result."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    _, _, model, opt = _trained(ctx, count=False)
    for kind, rank0_only in FORMS:
        what = f"{kind}{' rank0_only' if rank0_only else ''}"
        osd = _osd(ctx, model, opt, kind, rank0_only, offload=False)
        given = osd if osd else {}
        before = _snapshot(given)
        results = []
        for attempt in ("first", "second"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with _context(ctx, model, kind, rank0_only):
                    results.append(_snapshot(fsdp.optim_state_dict_to_load(model, opt, given)))
            changed = _diff(_snapshot(given), before)
            assert changed is None, (
                f"{ctx.where()} {what}: the {attempt} optim_state_dict_to_load changed the "
                f"caller's dict: {changed}"
            )
        again = _diff(results[1], results[0], "second result")
        assert again is None, (
            f"{ctx.where()} {what}: loading the same dict twice gave different results: {again}"
        )


def _optim_input_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    said = [
        w
        for w in caught
        if issubclass(w.category, FutureWarning) and "optim_input" in str(w.message)
    ]
    return out, len(said)


@check(area=AREA, requires=REQUIRES, world_sizes=(1,))
def fsdp1_optim_input_deprecation(ctx):
    """S51: ``full_optim_state_dict``, ``shard_full_optim_state_dict`` and
    ``rekey_optim_state_dict`` warn once (FutureWarning naming ``optim_input``) when given
    ``optim_input=``, and never without it."""
    ns = ctx.impl.ns
    fsdp = ns.FullyShardedDataParallel
    oracle, _, model, opt = _trained(ctx, count=False)

    def params(module):
        return [p for g in _groups(module.named_parameters()) for p in g["params"]]

    counts = {}
    full, counts["full_optim_state_dict"] = _optim_input_warnings(
        fsdp.full_optim_state_dict, model, opt, rank0_only=False
    )
    _, with_input = _optim_input_warnings(
        fsdp.full_optim_state_dict, model, opt, optim_input=params(model), rank0_only=False
    )
    counts["full_optim_state_dict(optim_input=)"] = with_input
    _, counts["shard_full_optim_state_dict"] = _optim_input_warnings(
        fsdp.shard_full_optim_state_dict, full, model, optim=opt
    )
    _, counts["shard_full_optim_state_dict(optim_input=)"] = _optim_input_warnings(
        fsdp.shard_full_optim_state_dict, full, model, optim_input=params(model)
    )
    key = ns.OptimStateKeyType.PARAM_ID
    _, counts["rekey_optim_state_dict"] = _optim_input_warnings(
        fsdp.rekey_optim_state_dict, full, key, oracle
    )
    _, counts["rekey_optim_state_dict(optim_input=)"] = _optim_input_warnings(
        fsdp.rekey_optim_state_dict, full, key, oracle, optim_input=params(oracle)
    )
    want = {call: int(call.endswith("(optim_input=)")) for call in counts}
    assert counts == want, (
        f"{ctx.where()} FutureWarnings naming optim_input per call: {counts}, expected {want}"
    )


# parameters holding no element on rank 0 (the module docstring's layout), by world size
EMPTY_ON = {2: {0: {"inner.bias", "head.bias"}, 1: set()}}


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def fsdp1_optim_load_named_absent_param(ctx):
    """S52: with ``use_orig_params=True``, ``optim_state_dict_to_load(...,
    is_named_optimizer=True)`` of a FULL dict gives this rank state for the parameters holding
    elements here and none for the others (rank 0: ``inner.bias``, ``head.bias``), warning once
    for each of those, naming it and the rank ("... is not on rank0.")."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    oracle, model = _build(ctx, "plain", True)
    opt = torch.optim.Adam(_groups(model.named_parameters()), lr=1e-2)
    oopt = torch.optim.Adam(_groups(oracle.named_parameters()), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = _osd(ctx, model, opt, "full", offload=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _context(ctx, model, "full"):
            flat = fsdp.optim_state_dict_to_load(model, opt, osd, is_named_optimizer=True)
    absent = EMPTY_ON[ctx.world_size][ctx.rank]
    names = [n for n, _ in oracle.named_parameters()]
    warned = sorted(
        n
        for w in caught
        for n in names
        if f"'{n}'" in str(w.message) and "is not on rank" in str(w.message)
    )
    said = [str(w.message) for w in caught if "is not on rank" in str(w.message)]
    assert warned == sorted(absent) and all(f"rank{ctx.rank}" in s for s in said), (
        f"{ctx.where()} is_named_optimizer=True: warnings {said}, expected one per parameter "
        f"with no element on rank {ctx.rank} ({sorted(absent)}), naming it and rank{ctx.rank}"
    )
    held = sorted(ctx.impl.clean_fqn(k) for k in flat["state"])
    want = sorted(set(names) - absent)
    assert held == want, (
        f"{ctx.where()} is_named_optimizer=True: state for {held}, expected the parameters "
        f"holding elements on rank {ctx.rank}: {want}"
    )
