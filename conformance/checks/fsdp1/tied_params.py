"""Area "fsdp1_runtime": two original parameters of one unit tied to each other
(``use_orig_params=True``): ``model.double()`` keeps the tie (R92), replacing one of them is
refused (R93). Tied parameters inside ``no_sync()`` are ``no_sync.py``'s (R79, R110).

[Note: tied original parameters]
* ``model.double()`` keeps a tie between two original parameters of one unit
  (``use_orig_params=True``): both names give one float64 parameter, and the model trains as the
  unsharded one converted alike (R92).
* Replacing one of two tied original parameters of a unit with a new parameter is refused at the
  next forward with NotImplementedError "Changing shared parameters is not supported yet" (R93).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _global_batch
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import B, assert_close
from conformance.checks.fsdp1.flat_param_edges import FP64
from conformance.checks.fsdp1.training import assert_params_equal_oracle
from conformance.registry import check


# ------------------------------------------------------------------------------ R92, R93
def _tied() -> nn.Sequential:
    """``Sequential(Linear(4, 4), Tanh(), Linear(4, 4))`` with ``2.weight`` the same parameter
    as ``0.weight``."""
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    seq[2].weight = seq[0].weight
    return seq


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_MODULE_TO},
    world_sizes=(1, 2),
)
def tied_params_double(ctx):
    """R92: one unit (``use_orig_params=True``) over ``Sequential(Linear(4, 4), Tanh(),
    Linear(4, 4))`` whose ``2.weight`` is ``0.weight``; ``model.double()`` before the first
    forward: every parameter of the wrapped module is float64, ``2.weight`` is still the same
    object as ``0.weight``; a forward (float64 output), backward (each rank's samples) and SGD
    step equal the unsharded model converted alike: its parameters after the step."""
    ctx.seed(0)
    oracle = _tied().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, use_orig_params=True)
    model.double()
    oracle.double()
    inner = model.module
    dtypes = {n: p.dtype for n, p in inner.named_parameters(remove_duplicate=False)}
    assert set(dtypes.values()) == {torch.float64}, (
        f"{ctx.where()} after .double(): parameter dtypes {dtypes}, expected float64 throughout"
    )
    assert inner[2].weight is inner[0].weight, (
        f"{ctx.where()} after .double(): 2.weight is no longer the same parameter as 0.weight"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x = _global_batch(ctx, 92, torch.float64)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    out = model(x[mine])
    assert out.dtype == torch.float64, f"{ctx.where()} forward output {out.dtype}"
    with torch.no_grad():
        assert_close(ctx, "forward after .double()", out, oracle(x)[mine], FP64)
    out.square().sum().div(B).backward()
    oracle(x).square().sum().div(ctx.world_size * B).backward()
    opt.step()
    oopt.step()
    assert_params_equal_oracle(ctx, model, oracle, "after .double() and a step", FP64)


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def tied_param_replaced_refused(ctx):
    """R93: one unit (``use_orig_params=True``) over ``Sequential(Linear(4, 4), Tanh(), Linear(4,
    4))`` whose ``2.weight`` is ``0.weight``; after construction ``2.weight`` is assigned a new
    ``nn.Parameter`` of zeros (breaking the tie): the next forward raises NotImplementedError
    "Changing shared parameters is not supported yet" on every rank."""
    ctx.seed(0)
    model = ctx.impl.shard(_tied().to(ctx.device), ctx, use_orig_params=True)
    inner = model.module

    def untie():
        inner[2].weight = nn.Parameter(torch.zeros(4, 4, device=ctx.device))

    expect_error(
        ctx,
        "forward after 2.weight, tied to 0.weight, was replaced",
        NotImplementedError,
        r"Changing shared parameters is not supported yet",
        untie,
        lambda: model(_global_batch(ctx, 93)),
    )
