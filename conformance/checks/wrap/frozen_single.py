"""Area "wrap": W12's mixed ``requires_grad`` rule at its smallest (W24).

[Note: one frozen and one trainable parameter already mix]
A unit mixes frozen and trainable parameters as soon as it manages one of each. On
``Sequential`` of four ``Linear(4, 4)`` with ``0.bias``, ``1.weight`` and all of ``3`` frozen and
``ModuleWrapPolicy({Linear})``, units ``0`` and ``1`` each manage one frozen and one trainable
parameter (weight 16 elements, bias 4), so W12 applies to both, and to neither the wholly
trainable ``2`` nor the wholly frozen ``3``: with ``use_orig_params=True`` one
UserWarning per unit in post-order (``0`` then ``1``), whose message gives the unit's total numel
and its trainable numel (20 instead of 16 for ``0``, 20 instead of 4 for ``1``) and both lists of
names; with ``use_orig_params=False`` ValueError for unit ``0``, the first in post-order.
"""

from __future__ import annotations

import functools
import warnings

from torch import nn

from conformance.adapters import base
from conformance.checks.wrap._cases import user_warnings
from conformance.checks.wrap._helpers import device_id, expect_raise, fsdp1_units
from conformance.registry import check

# unit -> (trainable names, frozen names, trainable numel)
UNITS = {"0": (["0.weight"], ["0.bias"], 16), "1": (["1.bias"], ["1.weight"], 4)}


def _message(unit: str, use_orig_params: bool) -> str:
    trainable, frozen, numel = UNITS[unit]
    msg = f"{unit} has both parameters with requires_grad=True and False. "
    if use_orig_params:
        msg += (
            "We do not recommend wrapping such modules since the gradient memory usage will be "
            f"higher than expected (20 numel instead of {numel} numel before sharding via "
            "reduce-scatter). "
        )
    else:
        msg += "FSDP does not support wrapping such modules when use_orig_params=False. "
    return msg + (
        "If possible, wrap the frozen parameters with FSDP separately.\n"
        f"The following parameters have requires_grad=True:\n{trainable}\n"
        f"The following parameters have requires_grad=False:\n{frozen}"
    )


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    cases={"use-orig-params": {"use_orig_params": True}, "flat-params": {"use_orig_params": False}},
    world_sizes=(1,),
)
def fsdp1_single_frozen_param(ctx, use_orig_params):
    """W24: a unit managing exactly one frozen and one trainable parameter is mixed (W12): with
    use_orig_params=True one warning per such unit (``0``, ``1``) and the planned units, with
    False ValueError naming unit ``0``."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    for p in (model[0].bias, model[1].weight, *model[3].parameters()):
        p.requires_grad_(False)
    build = functools.partial(
        ns.FullyShardedDataParallel,
        model,
        auto_wrap_policy=ns.wrap.ModuleWrapPolicy({nn.Linear}),
        use_orig_params=use_orig_params,
        device_id=device_id(ctx),
    )
    if not use_orig_params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expect_raise(ctx, "W24", ValueError, _message("0", False), build)
        return
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wrapped = build()
    got = user_warnings(record, "requires_grad=True and False")
    want = [_message(unit, True) for unit in ("0", "1")]
    assert got == want, f"{ctx.where()} W24 warnings {got}, expected {want}"
    units = sorted(fsdp1_units(ctx, wrapped))
    assert units == ["", "0", "1", "2", "3"], f"{ctx.where()} W24 units {units}"
