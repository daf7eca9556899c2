"""Area "fsdp1_runtime": what ``torch.compile`` sees of the modules an FSDP1 unit manages (R114).

[Note: FSDP1 and dynamo]
Dynamo does not trace FSDP1's own code; FSDP1 instead marks every module it manages (its wrapped
module's tree, ignored modules left out) with the unit's ``use_orig_params``, and dynamo reads the
mark when it meets such a module: it supports only ``use_orig_params=True``, so compiling a
managed module of a unit with flat parameters under ``fullgraph=True`` raises
``torch._dynamo.exc.Unsupported`` ("FSDP with use_orig_params=False") instead of tracing views that
FSDP replaces on every unshard. An ignored module is the user's own: it compiles like any module.
Inside ``summon_full_params`` both modules hold their full parameters, so an eager call of the
unsharded copy is the oracle of every compiled call that runs. ``backend="eager"`` generates no
code. Capability ``fsdp1-dynamo``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_RUNTIME, base.FSDP1_DYNAMO}
REFUSAL = "FSDP with use_orig_params=False"


def _compiled(module: nn.Module, x: torch.Tensor):
    """(output, None) of ``torch.compile(module, fullgraph=True)(x)``, or (None, the error)."""
    try:
        return torch.compile(module, backend="eager", fullgraph=True)(x), None
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return None, exc


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"orig": {"orig": True}, "flat": {"orig": False}},
    world_sizes=(1, 2),
)
def compile_managed_and_ignored(ctx, orig):
    """R114: one unit with ``ignored_modules=[ign]`` over ``Sequential(lin, ign)``; inside
    ``summon_full_params``, ``torch.compile(lin, backend="eager", fullgraph=True)(x)`` raises
    ``torch._dynamo.exc.Unsupported`` "FSDP with use_orig_params=False" under
    ``use_orig_params=False`` and returns the unsharded ``lin(x)`` under ``use_orig_params=True``;
    ``torch.compile(ign, ...)(x)`` returns the unsharded ``ign(x)`` in both."""
    from torch._dynamo.exc import Unsupported

    torch._dynamo.reset()  # no cached trace of nn.Linear from another case decides this one
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    plain = copy.deepcopy(oracle)
    lin, ign = plain[0], plain[1]
    model = ctx.impl.shard(plain, ctx, ignored_modules=[ign], use_orig_params=orig)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).to(ctx.device)

    def both():
        with fsdp.summon_full_params(model, writeback=False):
            return _compiled(lin, x), _compiled(ign, x)

    (out, err), (ign_out, ign_err) = first_error_everywhere(ctx, both)
    with torch.no_grad():
        want, ign_want = oracle[0](x), oracle[1](x)
    assert ign_err is None, (
        f"{ctx.where()} compiling the ignored module raised {type(ign_err).__name__}: "
        f"{str(ign_err)[:300]}; an ignored module is not FSDP's and compiles like any module"
    )
    assert_close(ctx, "compiled ignored module's output", ign_out, ign_want, FP32["loss"])
    if orig:
        assert err is None, (
            f"{ctx.where()} compiling a managed module of a use_orig_params=True unit raised "
            f"{type(err).__name__}: {str(err)[:300]}; dynamo supports that setting"
        )
        assert_close(ctx, "compiled managed module's output", out, want, FP32["loss"])
        return
    assert isinstance(err, Unsupported) and REFUSAL in str(err), (
        f"{ctx.where()} compiling a managed module of a use_orig_params=False unit gave "
        f"{type(err).__name__ if err else 'an output'}: {str(err)[:300] if err else ''}; "
        f"expected torch._dynamo.exc.Unsupported {REFUSAL!r}"
    )
