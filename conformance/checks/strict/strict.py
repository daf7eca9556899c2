"""Area "strict": this project's rules beyond upstream's contract (X1-X3).

The contract (what is rejected, with which error) is checked by the ``bad_input`` and
``state_dict`` areas; the checks here run the same cases and then ask more of the implementation:

* X1: a call that is rejected (``fully_shard`` with a bad argument or parameter, a forward on
  unmaterialized meta parameters) leaves the module exactly as it was: every submodule keeps its
  class, every parameter is the same object with the same values.
* X2: after ``fully_shard`` rejected a bad argument, a correct call on the same module shards it
  as usual.
* X3: a ``load_state_dict`` that raises changes nothing: every parameter and buffer keeps its
  value, byte for byte.

Upstream torch does not promise these (its expectation files list the strict cases it fails), so a
strict failure is a deviation from this project's rule, not a broken contract; both show as their
own rows of the matrix.
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks.fully_shard import bad_input as contract
from conformance.checks.state_dict import bad_input as sd_contract
from conformance.registry import check

AREA = "strict"
API = contract.API
RAF = API | {base.RESHARD_AFTER_FORWARD}
PLACEMENT = API | {base.SHARD_PLACEMENT_FN}


# ------------------------------------------------------------- X1: a rejected call changes nothing
@check(area=AREA, requires=API)
def scalar_parameter(ctx):
    """A fully_shard rejected for a scalar parameter leaves the module as it was (X1, P12)."""
    contract.scalar_parameter(ctx, strict=True)


@check(area=AREA, requires=API, cases=contract.NONCONTIGUOUS_CASES)
def noncontiguous_parameter(ctx, kind):
    """A fully_shard rejected for a non-contiguous parameter leaves the module as it was (X1, P12)."""
    contract.noncontiguous_parameter(ctx, kind, strict=True)


@check(area=AREA, requires=API)
def mesh_3d(ctx):
    """A fully_shard rejected for a 3-D mesh leaves the module as it was (X1, P12)."""
    contract.mesh_3d(ctx, strict=True)


@check(area=AREA, requires=API | {base.HSDP})
def mesh_2d_without_names(ctx):
    """A fully_shard rejected for an unnamed 2-D mesh leaves the module as it was (X1, P12)."""
    contract.mesh_2d_without_names(ctx, strict=True)


@check(area=AREA, requires=RAF, cases=contract.RAF_CASES)
def invalid_reshard_after_forward(ctx, name):
    """A fully_shard rejected for its reshard_after_forward leaves the module as it was (X1, P3)."""
    contract.invalid_reshard_after_forward(ctx, name, strict=True)


@check(area=AREA, requires=RAF, world_sizes=(4,))
def invalid_reshard_after_forward_non_factor(ctx):
    """A fully_shard rejected for reshard_after_forward=3 at world size 4 leaves the module as it
    was (X1, P3)."""
    contract.invalid_reshard_after_forward_non_factor(ctx, strict=True)


@check(area=AREA, requires=PLACEMENT, cases=contract.PLACEMENT_CASES)
@check(area=AREA, requires=PLACEMENT, cases=contract.UNEVEN_PLACEMENT_CASES, min_world_size=2)
def invalid_shard_placement(ctx, name):
    """A fully_shard rejected for its shard_placement_fn result leaves the module as it was (X1,
    P13)."""
    contract.invalid_shard_placement(ctx, name, strict=True)


POLICY_CASES = {
    "mp-none": ("mp_policy", lambda: None),
    "mp-dict": ("mp_policy", lambda: {"param_dtype": torch.bfloat16}),
    "offload-none": ("offload_policy", lambda: None),
    "offload-bool": ("offload_policy", lambda: True),
}


@check(area=AREA, requires=API, cases={k: {"name": k} for k in POLICY_CASES})
def policy_type_refused(ctx, name):
    """fully_shard with an mp_policy / offload_policy of the wrong type (None, a dict of dtypes,
    a bool) raises TypeError naming that argument at the call and leaves the module as it was
    (X4, X1)."""
    arg, value = POLICY_CASES[name]
    model = contract.Two().to(ctx.device)
    contract.expect_rejected(
        ctx,
        model,
        lambda: ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, **{arg: value()}),
        TypeError,
        arg,
        f"fully_shard({arg}={value()!r})",
        strict=True,
    )


@check(area=AREA, requires=API)
def forward_on_meta_params(ctx):
    """A forward rejected because the parameters are still on the meta device leaves them as they
    were (X1, P10)."""
    contract.forward_on_meta_params(ctx, strict=True)


# ------------------------------------------------------------- X2: a correct retry works
RETRY_CASES = {
    "after-3d-mesh": {
        "bad": lambda ctx: {"mesh": ctx.make_mesh((ctx.world_size, 1, 1), ("a", "b", "c"))}
    },
    "after-bad-reshard": {"bad": lambda ctx: {"mesh": ctx.mesh, "reshard_after_forward": "yes"}},
}


@check(area=AREA, requires=API, cases={k: {"name": k} for k in RETRY_CASES})
def valid_call_after_rejection(ctx, name):
    """After fully_shard rejected a bad argument, a correct call on the same (untouched) module
    shards it as usual: DTensor parameters whose full values are the originals (X2)."""
    from torch.distributed.tensor import DTensor

    model = contract.Two().to(ctx.device)
    try:
        ctx.impl.ns.fully_shard(model, **RETRY_CASES[name]["bad"](ctx))
    except (ValueError, AssertionError, NotImplementedError):
        pass
    else:
        raise AssertionError(f"{ctx.where()} the bad call ({name}) was accepted")
    originals = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    for fqn, param in model.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {fqn}: a valid fully_shard after the rejected one did not shard it "
            f"(got {type(param).__name__}, expected a DTensor)"
        )
        assert torch.equal(param.full_tensor().detach().cpu(), originals[fqn]), (
            f"{ctx.where()} {fqn}: values differ from the originals after the valid fully_shard"
        )


# ------------------------------------------------------------- X3: a failed load changes nothing
@check(area=AREA, cases=sd_contract.BAD_INPUT_CASES)
def load_bad_input(ctx, kind, bad):
    """A load_state_dict rejected for a wrong shape, a missing key under strict, or the wrong
    tensor type leaves every parameter and buffer byte for byte as it was (X3, S2, S5, S7, P8)."""
    sd_contract.bad_input(ctx, kind, bad, strict=True)
