"""Area "wrap": ``size_based_auto_wrap_policy(exclude_wrap_modules=...)`` (W22).

[Note: the exclusion set replaces the default]
``exclude_wrap_modules`` names the classes the size rule never *wraps* (it still looks into
them); the default is ``{ModuleList, ModuleDict}``, and a set passed in replaces it rather than
adding to it. On ``Sequential(Linear(10, 10), ModuleList([Linear(5, 5)] * 2), Linear(6, 6))``
(numels 110, 60 = 2 x 30, 42) at ``min_num_params=40``: by default the two large Linears become
units and the ModuleList does not (excluded container; its 30-element children are too small);
with ``exclude_wrap_modules={Linear}`` no Linear becomes a unit and the ModuleList (60) does.
"""

from __future__ import annotations

import functools
import warnings

from torch import nn

from conformance.adapters import base
from conformance.checks.wrap._helpers import device_id, fsdp1_units
from conformance.registry import check


def _model():
    return nn.Sequential(
        nn.Linear(10, 10), nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), nn.Linear(6, 6)
    )


CASES = {
    "default": {"exclude": None, "units": ("0", "2", "")},
    "exclude_linear": {"exclude": "Linear", "units": ("1", "")},
}


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, cases=CASES, world_sizes=(1, 2))
def size_policy_exclude_wrap_modules(ctx, exclude, units):
    """W22: ``size_based_auto_wrap_policy(min_num_params=40, exclude_wrap_modules=...)``
    answers "wrap" for a 110-element Linear and not for a 60-element ModuleList by default; with
    ``{Linear}`` the other way round (the set replaces the default), and it still answers
    "recurse" for both; ``FullyShardedDataParallel(model, auto_wrap_policy=...)`` then builds
    exactly those units plus the root."""
    W = ctx.impl.ns.wrap
    kwargs = {"min_num_params": 40}
    if exclude:
        kwargs["exclude_wrap_modules"] = {nn.Linear}
    policy = functools.partial(W.size_based_auto_wrap_policy, **kwargs)
    model = _model().to(ctx.device)
    for module, numel, name in ((model[0], 110, "Linear(10, 10)"), (model[1], 60, "ModuleList")):
        wrap = policy(module=module, recurse=False, nonwrapped_numel=numel)
        want = (name == "ModuleList") == bool(exclude)
        assert bool(wrap) == want, (
            f"{ctx.where()} exclude_wrap_modules={exclude}: wrap answer for {name} ({numel}) "
            f"is {wrap}, expected {want}"
        )
        assert policy(module=module, recurse=True, nonwrapped_numel=numel), (
            f"{ctx.where()} exclude_wrap_modules={exclude}: recurse answer for {name} is False"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ctx.impl.ns.FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=device_id(ctx)
        )
    got = fsdp1_units(ctx, wrapped)
    assert set(got) == set(units), (
        f"{ctx.where()} exclude_wrap_modules={exclude}: units {sorted(got)}, expected "
        f"{sorted(units)}"
    )
