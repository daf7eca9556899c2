"""Area "state_dict": FULL optimizer state dicts of FSDP1 keep the ranks consistent: a save refuses
ranks that disagree on a value every rank holds whole (S60), and a ``rank0_only`` load gives every
rank rank 0's entries that name no parameter, and lets every rank return (S61).

[Note: a bounded wait for a rank that may never return]
S61's upstream failure is a desynchronisation: on torch 2.13 rank 0 alone enters a broadcast that
the other ranks never join, so it waits forever. Another collective to find out would pair with
that broadcast (gloo matches collectives by their order), so each rank instead counts itself in on
a key of the default group's store when its call returned and waits, at most ``RETURN_WAIT``
seconds, for the count to reach the world size; a rank that waited in vain fails with a message
naming how many ranks returned. The key carries a token rank 0 broadcasts before the call, so no
two runs of the check share a count. The run's own timeout then ends the rank still waiting.
"""

from __future__ import annotations

import time
import uuid
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import broadcast_from_rank0
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_OPTIM_STATE_DICT, base.TRAINING}
# A returning call takes milliseconds (0.02 s at ws 2 on 2 cores); a wait of this many seconds
# tells a rank that never returns from one delayed by a loaded machine (the ranks do the same work
# up to the call).
RETURN_WAIT = 3.0


def _full_optim(ctx, model, rank0_only=False):
    ns = ctx.impl.ns
    return ns.FullyShardedDataParallel.state_dict_type(
        model,
        ns.StateDictType.FULL_STATE_DICT,
        ns.FullStateDictConfig(),
        ns.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


def _stepped(ctx, module, use_orig_params, salt):
    """One unit over ``module`` after one Adam step on the same batch on every rank."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = fsdp(module.to(ctx.device), use_orig_params=use_orig_params, **_kwargs(ctx))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(salt)
    model(torch.randn(2, module.in_features, generator=g).to(ctx.device)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return fsdp, model, opt


# ------------------------------------------------------------------------------ S60
@check(
    area="state_dict",
    requires=REQUIRES,
    cases={"step_tensor": {"entry": "step"}, "python_value": {"entry": "note"}},
    min_world_size=2,
)
def fsdp1_optim_state_ranks_disagree(ctx, entry):
    """S60: the FULL ``optim_state_dict`` of one unit (``use_orig_params=True``) over
    ``Linear(8, 8)``, whose ``weight`` has elements on every rank, after one Adam step, refuses a
    state in which rank 1's value of an entry every rank holds whole differs from the others':
    ``step`` set to ``tensor(5.)`` on rank 1 only, or a Python entry ``note`` (1 on every rank, 2
    on rank 1); every rank raises AssertionError "Rank 1 has different values for <entry>"."""
    ctx.seed(0)
    fsdp, model, opt = _stepped(ctx, nn.Linear(8, 8), True, 60)
    weight = next(p for n, p in model.named_parameters() if n.endswith("weight"))
    if weight not in opt.state:
        raise AssertionError(f"{ctx.where()} no optimizer state for weight after the step")
    if entry == "step":
        if ctx.rank == 1:
            opt.state[weight]["step"] = torch.tensor(5.0)
    else:
        opt.state[weight]["note"] = 2 if ctx.rank == 1 else 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _full_optim(ctx, model):
                osd = fsdp.optim_state_dict(model, opt)
    except AssertionError as exc:
        assert f"Rank 1 has different values for {entry}" in str(exc), (
            f"{ctx.where()} AssertionError {str(exc)[:300]!r} does not say 'Rank 1 has "
            f"different values for {entry}'"
        )
        return
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} raised {type(exc).__name__}: {str(exc)[:300]}, expected "
            f"AssertionError 'Rank 1 has different values for {entry}'"
        ) from exc
    got = {name: state.get(entry) for name, state in osd["state"].items()}
    raise AssertionError(
        f"{ctx.where()} ranks disagreeing on {entry!r} accepted: the dict holds {got}"
    )


# ------------------------------------------------------------------------------ S61
def _wait_all_returned(ctx, token: str) -> None:
    """See [Note: a bounded wait for a rank that may never return]."""
    if ctx.world_size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"fsdp-conformance/S61/{token}"
    store.add(key, 1)
    deadline = time.monotonic() + RETURN_WAIT
    while (count := store.add(key, 0)) < ctx.world_size:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{ctx.where()} only {count} of {ctx.world_size} ranks returned from the "
                f"rank0_only optim_state_dict_to_load within {RETURN_WAIT:g} s (this rank "
                "did: the ranks diverged)"
            )
        time.sleep(0.01)


USER_STATE = {
    "extra": torch.tensor([1.0, 2.0, 3.0]),
    "count": torch.tensor(7.0),
    "note": "kept",
}


@check(
    area="state_dict",
    requires=REQUIRES,
    cases={"orig_params": {"use_orig_params": True}, "flat": {"use_orig_params": False}},
    world_sizes=(1, 2),
)
def fsdp1_optim_load_rank0_only_user_state(ctx, use_orig_params):
    """S61: a FULL optimizer state dict loaded with ``rank0_only=True`` (rank 0 passes it to
    ``optim_state_dict_to_load``, the others ``{}``) whose ``state`` also holds entries keyed by
    no parameter (``extra``: ``tensor([1., 2., 3.])``, ``count``: ``tensor(7.)``, ``note``:
    ``"kept"``) returns on every rank, within a bounded wait, and every rank's result holds those
    entries as rank 0 passed them: a tensor of the same shape, dtype and values, the string equal
    (one unit over ``Linear(4, 4)`` after an Adam step, ``use_orig_params`` True and False)."""
    ctx.seed(0)
    fsdp, model, opt = _stepped(ctx, nn.Linear(4, 4), use_orig_params, 61)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _full_optim(ctx, model):
            osd = fsdp.optim_state_dict(model, opt)
        osd["state"].update(
            {k: v.clone() if torch.is_tensor(v) else v for k, v in USER_STATE.items()}
        )
        token = broadcast_from_rank0(ctx, uuid.uuid4().hex)
        with _full_optim(ctx, model, rank0_only=True):
            got = fsdp.optim_state_dict_to_load(model, opt, osd if ctx.rank == 0 else {})
    _wait_all_returned(ctx, token)
    state = got.get("state", {}) if isinstance(got, dict) else {}
    for key, want in USER_STATE.items():
        assert key in state, (
            f"{ctx.where()} the loaded dict lacks the entry {key!r} rank 0 passed (keys "
            f"{sorted(map(str, state))})"
        )
        value = state[key]
        if not torch.is_tensor(want):
            assert value == want, f"{ctx.where()} entry {key!r} is {value!r}, expected {want!r}"
            continue
        assert torch.is_tensor(value), (
            f"{ctx.where()} entry {key!r} is {value!r} ({type(value).__name__}), expected rank "
            f"0's tensor {want}"
        )
        assert value.shape == want.shape and value.dtype == want.dtype, (
            f"{ctx.where()} entry {key!r} is a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}, expected {want.dtype} of {tuple(want.shape)}"
        )
        assert_close(ctx, f"entry {key!r}", value.cpu(), want, FP32["param"])
