"""Area "fsdp2_state_dict": optimizer state dicts of a ``fully_shard`` model through
``torch.distributed.checkpoint.state_dict`` (P29).

[Note: the optimizer state each rank gets and loads]
``get_optimizer_state_dict(model, optim)`` keys the state by parameter FQN (the unsharded
model's names, also in ``param_groups[i]["params"]``). After the same steps, Adam's ``step``
equals the unsharded optimizer's and ``exp_avg`` / ``exp_avg_sq`` are, per option:
* ``full_state_dict=False``: DTensors whose local tensor is this rank's chunk of the unsharded
  optimizer's state (its shape is the parameter's local shape);
* ``full_state_dict=True``: plain tensors of the parameter's full shape, equal to the unsharded
  optimizer's, on every rank; with ``cpu_offload=True`` as well, only rank 0 gets the dict (on the
  CPU) and every other rank gets ``{}``.
Loading it back (``set_optimizer_state_dict``, or ``set_state_dict`` for model and optimizer at
once; under ``broadcast_from_rank0=True`` only rank 0 passes the dicts, the others ``{}``) into
a freshly built sharded model and optimizer restores that state, so one more step gives the
unsharded model's parameters after the same number of steps.

The oracle is the unsharded model with its own Adam, fed every global batch (mean losses), next
to the sharded model fed this rank's samples.
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.optim_state import STATE_TOL, assert_state
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fully_shard.state_dict import PLAN, Net
from conformance.registry import check

REQUIRES = {base.DCP_HELPERS, base.DTENSOR_PARAMS, base.FSDP2_API, base.TRAINING}
B = 2
STEPS = 2


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _batch(ctx, step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _step(ctx, model, opt, step, sharded=True):
    """One Adam step on the global batch (the oracle) or on this rank's samples of it."""
    x = _batch(ctx, step)
    if sharded:
        x = x[ctx.rank * B : (ctx.rank + 1) * B]
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _trained(ctx):
    """The oracle and the sharded model, each with its Adam, after ``STEPS`` steps."""
    oracle = Net(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt, opt = _adam(oracle.parameters()), _adam(model.parameters())
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step, sharded=False)
        _step(ctx, model, opt, step)
    return oracle, oopt, model, opt


def _assert_state(ctx, osd, oracle, oopt, full, what):
    """``osd`` holds the oracle optimizer's state under FQNs: full tensors or, sharded, DTensors
    of this rank's chunks."""
    from torch.distributed.tensor import DTensor

    def local_piece(name, key, value, _full_value):
        assert isinstance(value, DTensor), (
            f"{ctx.where()} {what} {name}.{key}: {type(value).__name__}, expected a "
            "DTensor of this rank's chunk"
        )
        return value.to_local()

    assert_state(ctx, osd, oracle, oopt, full, what, local_piece)


GET_CASES = {
    "sharded": {"full": False, "cpu_offload": False},
    "full": {"full": True, "cpu_offload": False},
    "full-cpu_offload": {"full": True, "cpu_offload": True},
}


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=GET_CASES, world_sizes=(2,))
def dsd_optim_get(ctx, full, cpu_offload):
    """P29: after two Adam steps ``get_optimizer_state_dict`` keys the state by FQN, ``step``
    equals the unsharded optimizer's, and ``exp_avg`` / ``exp_avg_sq`` are DTensors of this
    rank's chunks of the unsharded optimizer's (sharded) or its full tensors (full; with
    ``cpu_offload`` on the CPU on rank 0 and ``{}`` elsewhere)."""
    dsd = _dsd()
    oracle, oopt, model, opt = _trained(ctx)
    opts = dsd.StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)
    osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
    if full and cpu_offload and ctx.rank != 0:
        assert osd == {}, f"{ctx.where()} full + cpu_offload: expected {{}}, got {sorted(osd)}"
        return
    if cpu_offload:
        for name, state in osd["state"].items():
            for key in STATE_TOL:
                value = state[key]
                local = value.to_local() if hasattr(value, "to_local") else value
                assert local.device.type == "cpu", (
                    f"{ctx.where()} {name}.{key} on {local.device}, expected the CPU"
                )
    _assert_state(ctx, osd, oracle, oopt, full, "get_optimizer_state_dict")


LOAD_CASES = {
    "sharded": {"full": False, "broadcast": False},
    "full": {"full": True, "broadcast": False},
    "full-broadcast": {"full": True, "broadcast": True},
    "sharded-flatten": {"full": False, "broadcast": False, "flatten": True},
}


def _assert_flat_keys(ctx, osd, oracle):
    """``flatten_optimizer_state_dict=True``: one key per state entry, ``state.<fqn>.<name>``,
    and per parameter ``param_groups.<fqn>.<option>`` (e.g. ``lr``)."""
    for name, _ in oracle.named_parameters():
        for key in ("step", *STATE_TOL):
            assert f"state.{name}.{key}" in osd, (
                f"{ctx.where()} flattened optimizer state dict lacks 'state.{name}.{key}' "
                f"(keys {sorted(osd)[:6]}...)"
            )
        assert osd.get(f"param_groups.{name}.lr") == 1e-2, (
            f"{ctx.where()} flattened optimizer state dict: 'param_groups.{name}.lr' is "
            f"{osd.get(f'param_groups.{name}.lr')!r}, expected 0.01"
        )
    assert "state" not in osd and "param_groups" not in osd, (
        f"{ctx.where()} flattened optimizer state dict still has nested 'state' / 'param_groups'"
    )


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=LOAD_CASES, world_sizes=(2, 4))
def dsd_optim_load_then_step(ctx, full, broadcast, flatten=False):
    """P29/P28: the model and optimizer state of the trained sharded model (``get_state_dict``;
    under ``broadcast_from_rank0`` taken with ``cpu_offload`` so only rank 0 holds it, and the
    others pass ``{}``), loaded with ``set_state_dict`` into a freshly built sharded model with a
    fresh Adam, holds the unsharded optimizer's state (read back sharded), and one more step on
    both gives the unsharded model's parameters after three steps. With
    ``flatten_optimizer_state_dict=True`` the dict is flat (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<option>``) and loads back with the same option."""
    dsd = _dsd()
    oracle, oopt, model, opt = _trained(ctx)
    get_opts = dsd.StateDictOptions(
        full_state_dict=full, cpu_offload=broadcast, flatten_optimizer_state_dict=flatten
    )
    msd, osd = dsd.get_state_dict(model, opt, options=get_opts)
    if flatten:
        _assert_flat_keys(ctx, osd, oracle)
    if broadcast and ctx.rank != 0:
        assert msd == {} and osd == {}, (
            f"{ctx.where()} full + cpu_offload: expected {{}} on this rank, got {sorted(msd)}"
        )
    fresh = ctx.impl.shard(Net(3).to(ctx.device), ctx, plan=PLAN)
    fopt = _adam(fresh.parameters())
    set_opts = dsd.StateDictOptions(
        full_state_dict=full, broadcast_from_rank0=broadcast, flatten_optimizer_state_dict=flatten
    )
    if broadcast:  # model first, then optimizer (one set_state_dict call: see SPEC P29)
        dsd.set_model_state_dict(fresh, msd, options=set_opts)
        dsd.set_optimizer_state_dict(fresh, fopt, osd, options=set_opts)
    else:
        dsd.set_state_dict(
            fresh, fopt, model_state_dict=msd, optim_state_dict=osd, options=set_opts
        )
    _assert_state(
        ctx, dsd.get_optimizer_state_dict(fresh, fopt), oracle, oopt, False, "after the load"
    )
    _step(ctx, oracle, oopt, STEPS, sharded=False)
    _step(ctx, fresh, fopt, STEPS)
    for name, param in fresh.named_parameters():
        assert_close(
            ctx,
            f"{name} after loading and one more step (vs the unsharded model after {STEPS + 1})",
            param.detach().full_tensor(),
            oracle.get_parameter(name),
            FP32["param"],
        )


BEFORE_STEP_CASES = {
    # Adam before its first step: no state yet, the helpers must not create it
    "adam-get_optimizer_state_dict": {"optim": "adam", "via": "optim", "steps_before": 0},
    # SGD without momentum never has state: after a step, the next backward's grads must stay
    "sgd-get_state_dict": {"optim": "sgd", "via": "both", "steps_before": 1},
}


def _optim(kind, params):
    return _adam(params) if kind == "adam" else torch.optim.SGD(params, lr=0.1)


@check(area="fsdp2_state_dict", requires=REQUIRES, cases=BEFORE_STEP_CASES, world_sizes=(2,))
def dsd_optim_get_keeps_grads(ctx, optim, via, steps_before):
    """P29: taking the optimizer state dict (``get_optimizer_state_dict`` or ``get_state_dict``)
    between a backward and the step reads, and changes nothing: an optimizer that holds no state
    (Adam before its first step, SGD without momentum at any time) gives ``"state": {}``, every
    parameter keeps its gradient (same values), and the step that follows gives the unsharded
    model's parameters."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLAN)
    oopt, opt = _optim(optim, oracle.parameters()), _optim(optim, model.parameters())
    for step in range(steps_before):
        _step(ctx, oracle, oopt, step, sharded=False)
        _step(ctx, model, opt, step)
    x = _batch(ctx, steps_before)
    (oracle(x) ** 2).mean().backward()
    (model(x[ctx.rank * B : (ctx.rank + 1) * B]) ** 2).mean().backward()
    grads = {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}
    if via == "optim":
        osd = dsd.get_optimizer_state_dict(model, opt)
    else:
        _msd, osd = dsd.get_state_dict(model, opt)
    assert osd.get("state") == {}, (
        f"{ctx.where()} {via}: an optimizer without state gave state for "
        f"{sorted(osd.get('state', {}))}, expected 'state': {{}}"
    )
    for name, param in model.named_parameters():
        assert param.grad is not None, (
            f"{ctx.where()} {name}: .grad is None after taking the optimizer state dict; the "
            "gradient of the backward before it must stay"
        )
        assert torch.equal(param.grad.to_local(), grads[name]), (
            f"{ctx.where()} {name}: .grad changed while taking the optimizer state dict"
        )
    oopt.step()
    opt.step()
    for name, param in model.named_parameters():
        assert_close(
            ctx,
            f"{name} after the step that follows the state-dict call",
            param.detach().full_tensor(),
            oracle.get_parameter(name),
            FP32["param"],
        )
