"""Area "wrap", FSDP1's ``ignored_modules`` / ``ignored_states``: an FSDP module cannot be ignored
(W21).

[Note: ignoring an FSDP unit]
A module that already is an FSDP unit manages its own parameters; asking an enclosing FSDP1
constructor to ignore it is refused before anything else happens, whether it is listed in
``ignored_modules`` or (as a module list) in ``ignored_states``, with or without an
``auto_wrap_policy``: ValueError "`ignored_modules` should not include FSDP modules". The refused
call wraps nothing more: the manually built unit stays the only FSDP module of the model.
"""

from __future__ import annotations

import warnings

from torch import nn

from conformance.adapters import base
from conformance.checks.wrap import _models as zoo
from conformance.checks.wrap._helpers import device_id, expect_raise
from conformance.registry import check

MESSAGE = "`ignored_modules` should not include FSDP modules"

# case -> (constructor argument, auto_wrap_policy given)
CASES = {
    "ignored-modules": ("ignored_modules", False),
    "ignored-modules-with-policy": ("ignored_modules", True),
    "ignored-states": ("ignored_states", False),
}


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    world_sizes=(1, 2),
    cases={k: {"case": k} for k in CASES},
)
def fsdp1_ignored_fsdp_module_refused(ctx, case):
    """W21: with ``lin1`` of NormNet already wrapped by ``FullyShardedDataParallel``,
    ``FullyShardedDataParallel(model, ignored_modules=[lin1])`` (also as ``ignored_states`` and
    with an ``auto_wrap_policy``) raises ValueError "`ignored_modules` should not include FSDP
    modules", and the model holds no FSDP module but ``lin1``'s."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    argument, with_policy = CASES[case]
    model = zoo.NormNet()
    model.lin1 = FSDP(model.lin1, device_id=device_id(ctx))
    extra = {"auto_wrap_policy": ns.wrap.ModuleWrapPolicy({nn.BatchNorm1d})} if with_policy else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_raise(
            ctx,
            f"W21 {argument}=[FSDP(lin1)]",
            ValueError,
            MESSAGE,
            lambda: FSDP(model, device_id=device_id(ctx), **{argument: [model.lin1]}, **extra),
        )
    wrapped = [n for n, m in model.named_modules() if isinstance(m, FSDP)]
    assert wrapped == ["lin1"], (
        f"{ctx.where()} W21 {case}: FSDP modules after the refused call: {wrapped}, expected "
        f"['lin1'] only"
    )
