"""Area "state_dict": ``torch.distributed.checkpoint.state_dict`` (DSD) on FSDP1 models (S34, P120).

[Note: DSD over FullyShardedDataParallel]
DSD's helpers take an FSDP1 model as they take a ``fully_shard`` one: ``get_optimizer_state_dict
(model, optim, options=StateDictOptions(full_state_dict=True))`` runs FSDP1's own
``optim_state_dict`` (under FULL) in the model's process group and gives every rank the state
keyed by parameter FQN, full tensors equal to the unsharded optimizer's; ``set_model_state_dict``
/ ``set_optimizer_state_dict`` with the same option load such dicts into a freshly built model and
optimizer, and one more step gives the unsharded model's parameters. The root need not be FSDP1:
a plain module whose children are each wrapped (each its own FSDP1 root) works the same way.
With ``cpu_offload=True`` as well the full dict is rank 0's alone (the others get no state),
also over several optimizers, each of which every rank still gathers with the others (P120).

Every rank feeds the same global batch, so the FSDP average equals the unsharded gradient.
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.optim_state import STATE_TOL, assert_state
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.registry import check

REQUIRES = {
    base.DCP_HELPERS,
    base.FSDP1_API,
    base.FSDP1_OPTIM_STATE_DICT,
    base.FLAT_PARAM,
    base.TRAINING,
}
STEPS = 2


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _shard(ctx, module, root):
    """FSDP1 over ``module`` (``inner`` its own unit), or, ``root=False``, over each child."""
    if root:
        return ctx.impl.shard(module, ctx, plan=[("inner", {}), ("", {})])
    for name, child in list(module.named_children()):
        setattr(module, name, ctx.impl.shard(child, ctx, plan=[("", {})]))
    return module


def _step(ctx, model, opt, step):
    g = torch.Generator().manual_seed(800 + step)
    x = torch.randn(ctx.world_size * 2, 4, generator=g).to(ctx.device)
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _params(ctx, model, root):
    if root:
        return full_params(ctx, model)
    out = {}
    for name, child in model.named_children():
        out.update({f"{name}.{k}": v for k, v in full_params(ctx, child).items()})
    return out


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"fsdp_root": {"root": True}, "plain_root": {"root": False}},
    world_sizes=(2,),
)
def dsd_fsdp1_optim_round_trip(ctx, root):
    """S34: ``get_optimizer_state_dict(full_state_dict=True)`` of an FSDP1 model (FSDP1 root, or
    a plain root over FSDP1 children) after two Adam steps gives every rank the unsharded
    optimizer's state under FQNs; loaded with ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` into a fresh model and Adam it reads back equal, and one more
    step gives the unsharded model's parameters."""
    dsd = _dsd()
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = _shard(ctx, copy.deepcopy(oracle), root)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    opts = dsd.StateDictOptions(full_state_dict=True)

    def no_shards(name, key, value, full_value):
        raise AssertionError(f"{ctx.where()} {name}.{key}: expected a full tensor")

    osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
    assert_state(ctx, osd, oracle, oopt, True, "get_optimizer_state_dict", no_shards)
    msd = dsd.get_model_state_dict(model, options=opts)
    ctx.seed(5)
    fresh = _shard(ctx, InnerHeadNet().to(ctx.device), root)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_model_state_dict(fresh, msd, options=opts)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=opts)
    back = dsd.get_optimizer_state_dict(fresh, fopt, options=opts)
    assert_state(ctx, back, oracle, oopt, True, "after the load", no_shards)
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    got = _params(ctx, fresh, root)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} one step after the load", got[name], ref, FP32["param"])


@check(area=AREA, requires=REQUIRES, world_sizes=(2,))
def dsd_fsdp1_two_optimizers_rank0_offload(ctx):
    """P120: ``get_optimizer_state_dict(model, (opt_inner, opt_head),
    StateDictOptions(full_state_dict=True, cpu_offload=True))`` of an FSDP1 model (``inner`` its
    own unit) trained two Adam steps with one optimizer per unit gives rank 0 both optimizers'
    state under FQNs, CPU tensors equal to the unsharded optimizers' (the groups: ``inner``'s, then
    the head's, with their own lr), and every other rank no state and no groups; every rank takes
    part in both optimizers' gathers (a rank that stops after the first one's empty answer leaves
    rank 0 waiting)."""
    dsd = _dsd()
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = _shard(ctx, copy.deepcopy(oracle), True)
    lrs = (1e-2, 5e-3)

    def optimizers(m, inner_name):
        inner = [p for n, p in m.named_parameters() if inner_name in n]
        head = [p for n, p in m.named_parameters() if inner_name not in n]
        return torch.optim.Adam(inner, lr=lrs[0]), torch.optim.Adam(head, lr=lrs[1])

    oopts, opts = optimizers(oracle, "inner"), optimizers(model, "inner")
    for step in range(STEPS):
        for m, os_ in ((oracle, oopts), (model, opts)):
            _step(ctx, m, os_[0], step)
            os_[1].step()
            os_[1].zero_grad()
    osd = dsd.get_optimizer_state_dict(
        model, opts, options=dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if ctx.rank != 0:
        assert not osd.get("state") and not osd.get("param_groups"), (
            f"{ctx.where()} rank {ctx.rank} got {osd!r:.200}, expected no state and no groups "
            "(rank0_only under cpu_offload)"
        )
        return
    fqn_of = {p: n for n, p in oracle.named_parameters()}
    want_groups = [sorted(fqn_of[p] for p in o.param_groups[0]["params"]) for o in oopts]
    got_groups = [sorted(g["params"]) for g in osd.get("param_groups", [])]
    assert got_groups == want_groups, (
        f"{ctx.where()} param_groups list {got_groups}, expected one group per optimizer "
        f"{want_groups}"
    )
    got_lrs = [g["lr"] for g in osd["param_groups"]]
    assert got_lrs == list(lrs), f"{ctx.where()} groups' lr {got_lrs}, expected {list(lrs)}"
    assert sorted(osd["state"]) == sorted(fqn_of.values()), (
        f"{ctx.where()} state keys {sorted(osd['state'])}, expected {sorted(fqn_of.values())}"
    )
    for oopt in oopts:
        for param, want in oopt.state.items():
            name = fqn_of[param]
            mine = osd["state"][name]
            assert float(mine["step"]) == float(want["step"]), (
                f"{ctx.where()} {name}: step {mine['step']}, expected {want['step']}"
            )
            for key, tol in STATE_TOL.items():
                value = mine[key]
                assert type(value) is torch.Tensor and value.device.type == "cpu", (
                    f"{ctx.where()} {name}.{key}: {type(value).__name__} on "
                    f"{getattr(value, 'device', None)}, expected a full CPU tensor"
                )
                assert_close(ctx, f"{name}.{key}", value, want[key].cpu(), tol)
