"""Area "states", the unsharded Parameter object: ``unshard()`` / ``reshard()`` on demand, the same
object reused from iteration to iteration, and what an optimizer built after a ``no_grad`` forward
holds (P2, P4, P6, P18).

The states, the model (``Net`` of ``RecordingLinear`` units that record the parameter objects
forward computes with) and the state assertions are those of ``states.py`` (see its Note).
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks.fully_shard.states import (
    RAF_CASES,
    UNITS,
    assert_freed,
    assert_sharded,
    assert_unsharded,
    batch,
    build,
    build_case,
    last_seen,
    own_params,
    raf_check,
    unsharded_net,
)
from conformance.registry import check

# one SGD step of an unsharded copy and of the sharded model (same batch on every rank, so the
# averaged gradient is the copy's): fp32 sums of a few products, rounding only
STEP_LR, STEP_TOL = 0.1, dict(rtol=1e-5, atol=1e-6)


@raf_check(
    ("none", "false", "true"),
    {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS, base.TRAINING},
)
def optimizer_after_no_grad_forward(ctx, name):
    """A forward under ``torch.no_grad()`` before the optimizer exists (an evaluation or warm-up
    pass) leaves every unit in the state its reshard_after_forward implies after forward (P2), and
    an optimizer built then holds exactly what ``model.parameters()`` yields: the SHARDED DTensors of
    units that reshard, and the plain UNSHARDED Parameters forward computed with for the others (the
    root with None, every unit with False) -- tensors that stop being the module's parameters once
    ``reshard()`` (or the next backward) registers the SHARDED ones again, while the SHARDED ones it
    holds stay registered (the same objects). After ``reshard()`` on every unit, an optimizer built
    then holds only SHARDED parameters and one SGD step with it gives the full parameters of an
    unsharded copy after the same step (P2, P6)."""
    model, originals, raf = build_case(ctx, name)
    expect, where = (
        RAF_CASES[name]["expect"],
        f" after a no_grad forward (reshard_after_forward={raf})",
    )
    with torch.no_grad():
        model(batch(ctx))
    early = torch.optim.SGD(model.parameters(), lr=STEP_LR)  # built too early
    held = dict(zip([fqn for fqn, _ in model.named_parameters()], early.param_groups[0]["params"]))
    assert set(held) == set(originals), (
        f"{ctx.where()} optimizer holds {sorted(held)}, expected {sorted(originals)}"
    )
    for unit in UNITS:
        for fqn, attr, module in own_params(model, unit):
            param = held[fqn]
            assert param is getattr(module, attr), (
                f"{ctx.where()} {fqn}: the optimizer holds another tensor than the one registered{where}"
            )
            if expect[unit] == "S":
                assert_sharded(
                    ctx, fqn, param, originals[fqn], f" held by an optimizer built{where}"
                )
            else:
                assert_unsharded(
                    ctx, fqn, param, originals[fqn], f" held by an optimizer built{where}"
                )
                assert param is last_seen(model, fqn), (
                    f"{ctx.where()} {fqn}: the optimizer holds an unsharded tensor{where} that is not the "
                    f"Parameter forward computed with"
                )
    for unit in UNITS:
        model.get_submodule(unit).reshard()
    now = dict(model.named_parameters())
    for fqn, param in now.items():
        assert_sharded(ctx, fqn, param, originals[fqn], f" after reshard(){where}")
        unit = fqn.rpartition(".")[0]
        if expect[unit] == "S":  # (a "U" one it holds is a plain tensor: no longer registered)
            assert held[fqn] is param, (
                f"{ctx.where()} {fqn}: reshard() registered a new SHARDED Parameter; the one an optimizer "
                f"built{where} holds must stay the module's parameter"
            )

    opt = torch.optim.SGD(model.parameters(), lr=STEP_LR)
    oracle = unsharded_net(ctx, RAF_CASES[name].get("even", False))
    oopt = torch.optim.SGD(oracle.parameters(), lr=STEP_LR)
    for net, o in ((model, opt), (oracle, oopt)):
        net(batch(ctx)).sum().backward()
        o.step()
    after = dict(model.named_parameters())
    for fqn, want in oracle.named_parameters():
        got = after[fqn].full_tensor().detach().cpu()
        torch.testing.assert_close(
            got,
            want.detach().cpu(),
            **STEP_TOL,
            msg=lambda m, fqn=fqn: (
                f"{ctx.where()} {fqn} after one SGD step with an optimizer built after reshard() "
                f"(reshard_after_forward={raf}), against an unsharded copy: {m}"
            ),
        )


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS},
    cases={"sync": {"async_op": False}, "async": {"async_op": True}},
)
def unshard_api(ctx, async_op):
    """``unshard()`` (or ``unshard(async_op=True)`` then ``wait()``) before any forward registers
    plain Parameters with the original values on that unit only; ``reshard()`` frees them again,
    and a second unshard reuses the same Parameter object (P18, P4). The synchronous form (no
    argument the first time, ``async_op=False`` the second) returns None and needs no ``wait()``."""
    model, originals = build(ctx)
    first = {}
    for i, unit in enumerate(UNITS):
        module = model.get_submodule(unit)
        handle = module.unshard(async_op=True) if async_op else module.unshard()
        if async_op:
            assert handle is not None, (
                f"{ctx.where()} unshard(async_op=True) on {unit!r} returned None"
            )
            handle.wait()
        else:
            assert handle is None, (
                f"{ctx.where()} unshard() on {unit!r} returned {handle!r}; the default "
                "async_op=False returns None"
            )
        for fqn, name, owner in own_params(model, unit):
            param = getattr(owner, name)
            assert_unsharded(ctx, fqn, param, originals[fqn], f" after {unit or 'root'}.unshard()")
            first[fqn] = param
        for later in UNITS[i + 1 :]:  # units not yet unsharded stay sharded
            for fqn, name, owner in own_params(model, later):
                assert_sharded(
                    ctx,
                    fqn,
                    getattr(owner, name),
                    originals[fqn],
                    " while only earlier units are unsharded",
                )
    for unit in UNITS:
        model.get_submodule(unit).reshard()
    for fqn, param in model.named_parameters():
        assert_sharded(ctx, fqn, param, originals[fqn], " after reshard()")
        assert_freed(ctx, fqn, first[fqn], "after reshard()")
    for unit in UNITS:
        handle = model.get_submodule(unit).unshard(async_op=async_op)
        if async_op:
            handle.wait()
        else:
            assert handle is None, (
                f"{ctx.where()} unshard(async_op=False) on {unit!r} returned {handle!r}, "
                "expected None"
            )
        for fqn, name, owner in own_params(model, unit):
            assert getattr(owner, name) is first[fqn], (
                f"{ctx.where()} {fqn}: the second unshard() registered a new Parameter object; "
                f"expected the one created by the first (reused)"
            )
            assert_unsharded(
                ctx, fqn, getattr(owner, name), originals[fqn], " after a second unshard()"
            )
    for unit in UNITS:
        model.get_submodule(unit).reshard()


@raf_check(
    ("true", "false", "none", "int-half", "int-half-even"),
    {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS, base.TRAINING},
)
def unsharded_param_reused(ctx, name):
    """Across iterations (forward, backward, SGD step) each module computes with the same unsharded
    Parameter object, whose values are the updated parameters' full values."""
    model, _, raf = build_case(ctx, name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        model(batch(ctx)).sum().backward()
        opt.step()
        opt.zero_grad()
    for fqn, _param in model.named_parameters():
        unit, _, attr = fqn.rpartition(".")
        seen = [s[attr] for s in model.get_submodule(unit).seen]
        assert len(seen) >= 3, f"{ctx.where()} {fqn}: forward ran {len(seen)} times, expected 3"
        assert all(s is seen[0] for s in seen), (
            f"{ctx.where()} {fqn}: forward computed with {len({id(s) for s in seen})} different "
            f"unsharded Parameter objects over 3 iterations (raf={raf}); expected one, reused"
        )
    # the registered parameters after the last step are sharded; their full values are what the
    # next forward must see
    full = {fqn: p.full_tensor().detach().cpu() for fqn, p in model.named_parameters()}
    with torch.no_grad():
        model(batch(ctx))
    for fqn in full:
        seen = last_seen(model, fqn)
        if seen.untyped_storage().nbytes() == 0:
            continue  # already resharded; values were checked while registered in other checks
        assert torch.equal(seen.detach().cpu(), full[fqn]), (
            f"{ctx.where()} {fqn}: the unsharded parameter after 3 steps differs from the updated "
            f"sharded parameter's full_tensor()"
        )
    for unit in UNITS:
        model.get_submodule(unit).reshard()
