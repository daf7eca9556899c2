"""Area "wrap", FSDP1's ``ignored_modules`` / ``ignored_states`` arguments: what the constructor
refuses before it wraps anything (W18).

The expected messages are built from the rule: the distinct element types of the list, sorted by
their ``repr``.
"""

from __future__ import annotations

import warnings

from torch import nn

from conformance.adapters import base
from conformance.checks.wrap import _models as zoo
from conformance.checks.wrap._helpers import device_id, expect_raise
from conformance.registry import check


def _types(items) -> list[type]:
    return sorted({type(x) for x in items}, key=repr)


# case -> (constructor argument, which elements of NormNet it lists, the message's lead)
W18_CASES = {
    # a module and a parameter in one ignored_states list
    "states-module-and-param": ("ignored_states", ("lin1", "lin2.weight"), "all-or-all"),
    # the same, parameter first: the types are listed sorted, not in the list's order
    "states-param-and-module": ("ignored_states", ("lin2.weight", "lin1"), "all-or-all"),
    # ignored_modules takes modules only
    "modules-with-param": ("ignored_modules", ("lin1", "lin2.weight"), "modules-only"),
    # a one-element list is checked too
    "modules-only-param": ("ignored_modules", ("lin2.weight",), "modules-only"),
}
_LEADS = {
    "all-or-all": "ignored_states expects all nn.Parameter or all nn.Module list elements",
    "modules-only": "ignored_modules expects nn.Module list elements",
}


def _element(model: nn.Module, name: str):
    """The submodule or parameter ``name`` of ``model``."""
    if name in dict(model.named_modules()):
        return model.get_submodule(name)
    return model.get_parameter(name)


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    world_sizes=(1, 2),
    cases={k: {"case": k} for k in W18_CASES},
)
def fsdp1_ignored_states_types(ctx, case):
    """W18: FullyShardedDataParallel(model, ignored_states=[...]) whose list mixes nn.Module and
    nn.Parameter elements raises ValueError "ignored_states expects all nn.Parameter or all
    nn.Module list elements but got types [<sorted by repr>]" (an ignored_modules list holding
    a parameter: "ignored_modules expects nn.Module list elements but got types [...]"), with an
    auto_wrap_policy given and before any submodule is wrapped."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    argument, names, lead = W18_CASES[case]
    model = zoo.NormNet()
    items = [_element(model, n) for n in names]
    message = f"{_LEADS[lead]} but got types {_types(items)}"
    policy = ns.wrap.ModuleWrapPolicy({nn.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_raise(
            ctx,
            f"W18 {argument}={list(names)}",
            ValueError,
            message,
            lambda: FSDP(
                model, auto_wrap_policy=policy, device_id=device_id(ctx), **{argument: items}
            ),
        )
    wrapped = [n for n, m in model.named_modules() if isinstance(m, FSDP)]
    assert not wrapped, f"{ctx.where()} W18 {case}: the refused call wrapped {wrapped}"
