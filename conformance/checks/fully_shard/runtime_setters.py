"""Area "states": ``reshard_after_forward`` / ``reshard_after_backward`` changed at run time (P2).

[Note: the setters]
``FSDPModule.set_reshard_after_forward(flag, recurse=True)`` gives the module (and, with
``recurse``, every FSDP module below it) the behaviour of ``reshard_after_forward=flag``: after the
next forward its parameters are SHARDED (True) or stay UNSHARDED (False). Called before the first
forward it also overrides the root's default (a root built with ``None`` keeps its parameters after
forward; after ``set_reshard_after_forward(True)`` it reshards like every other unit). Anything but
a bool raises ValueError "reshard_after_forward should be a bool, got <type>".
``set_reshard_after_backward(False, recurse=True)`` keeps the unsharded parameters registered after
backward; ``reshard()`` then registers the SHARDED DTensors again, with their sharded gradients.

The model and the state assertions are ``states.py``'s (``Net``: units lin1, lin2 and the root).
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks.fully_shard.states import (
    UNITS,
    _check_after_forward,
    assert_sharded,
    assert_unsharded,
    batch,
    build,
    own_params,
)
from conformance.registry import check

REQUIRES = {base.FSDP2_API, base.RESHARD_AFTER_FORWARD, base.DTENSOR_PARAMS}

# case: (reshard_after_forward at build, unit to call the setter on, flag, recurse, expected states);
# recurse None: the call leaves the argument out, so its default (True) decides
SETTER_CASES = {
    "child-false": (True, "lin1", False, True, {"lin1": "U", "lin2": "S", "": "S"}),
    "root-true-overrides-default": (None, "", True, True, {"lin1": "S", "lin2": "S", "": "S"}),
    "root-false-no-recurse": (True, "", False, False, {"lin1": "S", "lin2": "S", "": "U"}),
    "all-false": (True, "", False, True, {"lin1": "U", "lin2": "U", "": "U"}),
    "all-false-recurse-default": (True, "", False, None, {"lin1": "U", "lin2": "U", "": "U"}),
}


@check(
    area="states",
    requires=REQUIRES,
    cases={name: {"name": name} for name in SETTER_CASES},
)
def set_reshard_after_forward_at_run_time(ctx, name):
    """After ``set_reshard_after_forward(flag, recurse)`` on a unit before the first forward, each
    unit's registered parameters after forward are in the state ``flag`` implies for the units it
    reached (False: UNSHARDED, the very objects forward used; True: SHARDED, the root included, its
    default overridden), and the others keep the state of their build-time value; ``recurse``
    left out means True (P2)."""
    built_raf, unit, flag, recurse, expect = SETTER_CASES[name]
    model, originals = build(ctx, reshard_after_forward=built_raf)
    setter = model.get_submodule(unit).set_reshard_after_forward
    if recurse is None:
        setter(flag)
    else:
        setter(flag, recurse=recurse)
    with torch.no_grad():
        model(batch(ctx))
    _check_after_forward(ctx, model, originals, expect, f"{built_raf}, then {name}")


@check(area="states", requires=REQUIRES)
def set_reshard_after_forward_rejects_non_bool(ctx):
    """``set_reshard_after_forward`` takes a bool only: an int raises ValueError naming the bool
    (the int form of ``reshard_after_forward`` exists at construction only) (P2, P3)."""
    model, _ = build(ctx)
    try:
        model.set_reshard_after_forward(1)
    except ValueError as exc:
        assert "reshard_after_forward should be a bool" in str(exc), (
            f"{ctx.where()} set_reshard_after_forward(1): ValueError {exc!r} does not say it "
            f"should be a bool"
        )
    else:
        raise AssertionError(f"{ctx.where()} set_reshard_after_forward(1) raised nothing")


@check(area="states", requires=REQUIRES)
def set_reshard_after_backward_false_keeps_unsharded(ctx):
    """With ``set_reshard_after_backward(False)`` every unit's parameters stay UNSHARDED (plain
    Parameters with the full values) after backward; ``reshard()`` on every unit then registers
    SHARDED DTensors with the original rows and a DTensor gradient of the same placements (P2)."""
    from torch.distributed.tensor import DTensor

    model, originals = build(ctx, reshard_after_forward=True)
    model.set_reshard_after_backward(False)
    model(batch(ctx)).sum().backward()
    for unit in UNITS:
        for fqn, attr, module in own_params(model, unit):
            assert_unsharded(
                ctx, fqn, getattr(module, attr), originals[fqn], " after backward (no reshard)"
            )
    for unit in UNITS:
        model.get_submodule(unit).reshard()
    for fqn, param in model.named_parameters():
        assert_sharded(ctx, fqn, param, originals[fqn], " after reshard()")
        assert isinstance(param.grad, DTensor), (
            f"{ctx.where()} {fqn}: grad after reshard() is {type(param.grad).__name__}, expected "
            f"the sharded DTensor gradient"
        )
        assert tuple(param.grad.placements) == tuple(param.placements), (
            f"{ctx.where()} {fqn}: grad placements {param.grad.placements} != {param.placements}"
        )
