"""Area "fsdp2_state_dict": the less travelled paths of ``torch.distributed.checkpoint.state_dict``
(DSD) optimizer state dicts on a ``fully_shard`` model (P52, P53). The model-dict edges and the
helpers are in ``dsd_model_edges.py``.

[Note: what DSD promises of optimizer dicts]
* Optimizer dicts: a list of optimizers gets one dict holding every optimizer's state and groups,
  and loads back split per optimizer; an optimizer's own ``state_dict()`` (ids, not FQNs) loads
  too; an optimizer group without parameters keeps its options through the dict; a strict load of
  a dict lacking a trained parameter's state is refused naming it (P52).
* ``flatten_optimizer_state_dict=True`` round trips state nested two levels deep, a weight shared
  by two modules and a frozen parameter in the optimizer (P53).

The oracle is the unsharded model with its own optimizer, fed the same global batch on every
rank; expected chunks come from ``_shared/rows.py``.
"""

from __future__ import annotations

import copy

import torch

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.dsd_model_edges import (
    AREA,
    STEPS,
    TRAIN,
    _dsd,
    _expect_raise,
    _sharded,
)
from conformance.checks.fully_shard.dsd_optim_groups import (
    _assert_params,
    _shared_weight_round_trip,
    _step,
)
from conformance.checks.fully_shard.dsd_optim_state import _assert_state
from conformance.checks.fully_shard.state_dict import Net
from conformance.registry import check


# ------------------------------------------------------------------- P52: optimizer dict forms
def _step_all(ctx, model, opts, step):
    """``_step`` (the same global batch on every rank) with several optimizers."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(ctx.world_size * 2, 4, generator=g).to(ctx.device)
    (model(x) ** 2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _per_module(model):
    """Two Adams: lin1's parameters at lr 1e-2, lin2's at 5e-3."""
    return [
        torch.optim.Adam(model.lin1.parameters(), lr=1e-2),
        torch.optim.Adam(model.lin2.parameters(), lr=5e-3),
    ]


def _oracle_two_groups(oracle):
    """The unsharded equivalent of ``_per_module``: one Adam with the same two groups (Adam's
    update is per parameter)."""
    return torch.optim.Adam(
        [
            {"params": list(oracle.lin1.parameters()), "lr": 1e-2},
            {"params": list(oracle.lin2.parameters()), "lr": 5e-3},
        ]
    )


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_list(ctx):
    """P52: ``get_optimizer_state_dict(model, [opt1, opt2])`` (lin1's and lin2's Adams) gives one
    dict with both optimizers' groups (each listing its module's FQNs with its own ``lr``) and the
    unsharded Adam's state for every parameter; ``set_optimizer_state_dict`` of it into fresh
    ``[opt1, opt2]`` gives each its own part (one more step: the unsharded model's parameters).
    An optimizer's own ``state_dict()`` (keyed by ids) loads through ``set_optimizer_state_dict``
    as it is. A dict lacking ``lin2.bias``'s state is refused under the default ``strict=True``
    with RuntimeError naming it; ``strict=False`` loads the rest."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt, opts = _oracle_two_groups(oracle), _per_module(model)
    for step in range(STEPS):
        _step_all(ctx, oracle, [oopt], step)
        _step_all(ctx, model, opts, step)
    osd = dsd.get_optimizer_state_dict(model, opts)
    _assert_state(ctx, osd, oracle, oopt, False, "two optimizers")
    groups = sorted((g["lr"], sorted(g["params"])) for g in osd["param_groups"])
    want = [(5e-3, ["lin2.bias", "lin2.weight"]), (1e-2, ["lin1.bias", "lin1.weight"])]
    assert groups == want, f"{ctx.where()} two optimizers: groups {groups}, expected {want}"
    msd = dsd.get_model_state_dict(model)

    fresh = _sharded(ctx, 3)
    fopts = _per_module(fresh)
    dsd.set_model_state_dict(fresh, dict(msd))
    dsd.set_optimizer_state_dict(fresh, fopts, osd)
    for fopt, module in zip(fopts, ("lin1", "lin2")):
        held = sorted(n for n, p in fresh.named_parameters() if p in fopt.state)
        assert held == [f"{module}.bias", f"{module}.weight"], (
            f"{ctx.where()} after the load, {module}'s optimizer holds state for {held}"
        )
    _step_all(ctx, oracle, [oopt], STEPS)
    _step_all(ctx, fresh, fopts, STEPS)
    _assert_params(ctx, fresh, oracle, "one step after loading two optimizers")

    # the optimizer's own (id-keyed) dict
    own = opts[1].state_dict()
    again = _sharded(ctx, 3)
    aopt = _per_module(again)[1]
    dsd.set_optimizer_state_dict(again, aopt, own)
    for name, p, q in zip(("weight", "bias"), model.lin2.parameters(), again.lin2.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            got, ref = aopt.state[q][key], opts[1].state[p][key]
            got = got.to_local() if hasattr(got, "to_local") else got
            ref = ref.to_local() if hasattr(ref, "to_local") else ref
            assert torch.equal(got, ref), (
                f"{ctx.where()} id-keyed load: lin2.{name} {key} differs from the saved one"
            )

    lacking = dsd.get_optimizer_state_dict(model, opts)
    del lacking["state"]["lin2.bias"]
    # (the dict shares its tensors with the optimizers' state, and an optimizer that loads a
    # dict keeps its ``step`` tensors, so compare with the values it holds now)
    saved = {k: float(v["step"]) for k, v in lacking["state"].items()}
    target = _sharded(ctx, 3)
    _expect_raise(
        ctx,
        RuntimeError,
        r"Missing optimizer state.*lin2\.bias",
        "strict load of an optimizer dict lacking lin2.bias",
        lambda: dsd.set_optimizer_state_dict(target, _per_module(target), copy.copy(lacking)),
    )
    topts = _per_module(target)
    dsd.set_optimizer_state_dict(target, topts, lacking, options=dsd.StateDictOptions(strict=False))
    for name, step in saved.items():
        p = target.get_parameter(name)
        opt = topts[0] if name.startswith("lin1") else topts[1]
        assert float(opt.state[p]["step"]) == step, (
            f"{ctx.where()} strict=False load: {name} step {opt.state[p]['step']}, expected "
            f"the dict's {step}"
        )


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_empty_group(ctx):
    """P52: an Adam with a second param group without parameters (``lr`` 0.5): the optimizer dict
    (sharded, and with ``full_state_dict=True``) lists that group with no FQNs and its ``lr``;
    loaded with the same options into a fresh optimizer whose empty group has ``lr`` 0.1, the
    empty group takes 0.5 and one more step gives the unsharded model's parameters. Two empty
    groups, or an empty group in one of several optimizers, are refused with ValueError
    ("zero parameters" / "multiple optimizers")."""
    dsd = _dsd()
    for full in (False, True):
        oracle = Net(0).to(ctx.device)
        model = _sharded(ctx, module=copy.deepcopy(oracle))
        oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        opt.add_param_group({"params": [], "lr": 0.5})
        for step in range(STEPS):
            _step_all(ctx, oracle, [oopt], step)
            _step_all(ctx, model, [opt], step)
        options = dsd.StateDictOptions(full_state_dict=full)
        osd = dsd.get_optimizer_state_dict(model, opt, options=options)
        groups = [(g["lr"], sorted(g["params"])) for g in osd["param_groups"]]
        names = sorted(n for n, _ in oracle.named_parameters())
        assert groups == [(1e-2, names), (0.5, [])], (
            f"{ctx.where()} full={full}: groups {groups}, expected {[(1e-2, names), (0.5, [])]}"
        )
        msd = dsd.get_model_state_dict(model)
        fresh = _sharded(ctx, 3)
        fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fopt.add_param_group({"params": [], "lr": 0.1})
        dsd.set_model_state_dict(fresh, msd)
        dsd.set_optimizer_state_dict(fresh, fopt, osd, options=options)
        assert fopt.param_groups[1]["lr"] == 0.5, (
            f"{ctx.where()} full={full}: the empty group's lr {fopt.param_groups[1]['lr']} after "
            "the load, expected the dict's 0.5"
        )
        _step_all(ctx, oracle, [oopt], STEPS)
        _step_all(ctx, fresh, [fopt], STEPS)
        _assert_params(ctx, fresh, oracle, f"one step after the load (full={full})")

    two = torch.optim.Adam(model.parameters(), lr=1e-2)
    two.add_param_group({"params": [], "lr": 0.5})
    two.add_param_group({"params": [], "lr": 0.2})
    twosd = dsd.get_optimizer_state_dict(model, two)
    _expect_raise(
        ctx,
        ValueError,
        r"zero parameters",
        "loading into an optimizer with two empty groups",
        lambda: dsd.set_optimizer_state_dict(model, two, twosd),
    )
    opts = _per_module(model)
    opts[0].add_param_group({"params": [], "lr": 0.5})
    listsd = dsd.get_optimizer_state_dict(model, opts)
    _expect_raise(
        ctx,
        ValueError,
        r"multiple optimizers",
        "loading two optimizers, one with an empty group",
        lambda: dsd.set_optimizer_state_dict(model, opts, listsd),
    )


# --------------------------------------------------------------------- P53: flattened edges
class _DeepSGD(torch.optim.SGD):
    """SGD keeping, per parameter it steps, ``info = {"stats": {"calls": n, "scale": n / 2}}``
    (state nested two levels below the entry)."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                calls = self.state[p].get("info", {}).get("stats", {}).get("calls", 0) + 1
                self.state[p]["info"] = {"stats": {"calls": calls, "scale": 0.5 * calls}}
        return out


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_flatten_edges(ctx):
    """P53: with ``flatten_optimizer_state_dict=True``: state nested two levels deep becomes
    ``state.<fqn>.info.stats.<key>`` and loads back as the unsharded optimizer's nested dict,
    while a frozen parameter in the optimizer gets no state entry (before the load and after);
    and on a model whose two modules share a weight the flattened Adam dict loads into a fresh
    model and optimizer, after which one more step gives the unsharded model's parameters."""
    dsd = _dsd()
    flat = dsd.StateDictOptions(flatten_optimizer_state_dict=True)
    oracle = Net(0).to(ctx.device)
    oracle.lin1.bias.requires_grad_(False)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt, opt = _DeepSGD(oracle.parameters()), _DeepSGD(model.parameters())
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    osd = dsd.get_optimizer_state_dict(model, opt, options=flat)
    for name, p in oracle.named_parameters():
        if not p.requires_grad:
            assert not any(k.startswith(f"state.{name}.") for k in osd), (
                f"{ctx.where()} flattened: state entries for the frozen {name}"
            )
            continue
        for key, value in oopt.state[p]["info"]["stats"].items():
            got = osd.get(f"state.{name}.info.stats.{key}")
            assert got == value, (
                f"{ctx.where()} flattened: state.{name}.info.stats.{key} = {got!r}, expected "
                f"{value!r}"
            )
    fresh = _sharded(ctx, module=copy.deepcopy(oracle))
    fopt = _DeepSGD(fresh.parameters())
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=flat)
    for (name, p), fp in zip(oracle.named_parameters(), fresh.parameters()):
        want = oopt.state[p].get("info")
        got = fopt.state[fp].get("info")
        assert got == want, (
            f"{ctx.where()} after the flattened load: {name} info {got!r}, expected {want!r}"
        )

    _shared_weight_round_trip(ctx, flat, "shared weight, flattened: ")


@check(area=AREA, requires=TRAIN, world_sizes=(2,))
def dsd_optim_full_extra_entry(ctx):
    """P52: a full optimizer dict (``full_state_dict=True``) of an ``amsgrad=True`` Adam loaded
    with the same option into a fresh plain Adam (which has no ``max_exp_avg_sq`` entry of its
    own): the optimizer takes the dict's options and every state entry, each moment this rank's
    chunk of the dict's, and one more step gives the unsharded amsgrad Adam's parameters."""
    dsd = _dsd()
    oracle = Net(0).to(ctx.device)
    model = _sharded(ctx, module=copy.deepcopy(oracle))
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2, amsgrad=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    full = dsd.StateDictOptions(full_state_dict=True)
    osd = dsd.get_optimizer_state_dict(model, opt, options=full)
    fresh = _sharded(ctx, module=copy.deepcopy(oracle))
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    dsd.set_optimizer_state_dict(fresh, fopt, osd, options=full)
    assert fopt.param_groups[0]["amsgrad"] is True, f"{ctx.where()} amsgrad not loaded"
    for (name, p), fp in zip(oracle.named_parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            got = fopt.state[fp].get(key)
            assert got is not None and hasattr(got, "to_local"), (
                f"{ctx.where()} {name}.{key} after the full load: {type(got).__name__}, expected "
                "a DTensor of this rank's chunk"
            )
            want = chunk_of(oopt.state[p][key].detach().cpu(), 0, ctx.world_size, ctx.rank)
            assert_close(
                ctx, f"{name}.{key} after the full load", got.to_local(), want, FP32["param"]
            )
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fresh, fopt, STEPS)
    _assert_params(ctx, fresh, oracle, "one step after the full amsgrad load")
