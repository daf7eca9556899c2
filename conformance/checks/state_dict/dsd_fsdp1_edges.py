"""Area "state_dict": ``torch.distributed.checkpoint.state_dict`` (DSD) on an FSDP1 model inside
a compiler wrapper, full and sharded (P50).

[Note: DSD through a compiler wrapper over FSDP1]
A compiler wrapper (``OptimizedModule``, what ``torch.compile`` and ``torch.compiler.disable``
return for a module) prefixes the keys of its own ``state_dict`` with ``_orig_mod.``. DSD's model
and optimizer dicts of the wrapped FSDP1 model are keyed by the unwrapped model's FQNs all the
same, with ``full_state_dict=True`` (full values) and without (FSDP1's sharded state dict), and
they load into a freshly built wrapped model and optimizer: one more step then gives the unsharded
model's parameters. Every rank feeds the same global batch, so the FSDP1 average equals the
unsharded gradient.

Upstream (torch 2.13): with ``use_orig_params=False`` ``set_optimizer_state_dict`` into the
wrapped model fails with AssertionError ("Expected 1 FQN for '..._flat_param', got 2"): its
compiler-prefix renaming walks ``named_parameters()``, which are flat parameters there (pinned as
an expected failure of torch-fsdp1).
"""

from __future__ import annotations

import copy

import torch

from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import AREA, InnerHeadNet, full_params
from conformance.checks.state_dict.dsd_fsdp1 import REQUIRES, STEPS, _dsd, _step
from conformance.registry import check


def _shard1(ctx, module, orig):
    """FSDP1 over ``module`` with ``inner`` its own unit."""
    options = {"use_orig_params": orig}
    return ctx.impl.shard(module, ctx, plan=[("inner", options), ("", options)])


@check(
    area=AREA,
    requires=REQUIRES,
    cases={
        "full-orig_params": {"full": True, "orig": True},
        "sharded-orig_params": {"full": False, "orig": True},
        "full-flat_param": {"full": True, "orig": False},
    },
    world_sizes=(2,),
)
def dsd_fsdp1_compiled_wrapper(ctx, full, orig):
    """P50: an FSDP1 model in a compiler wrapper (own keys ``_orig_mod.*``) after two Adam steps:
    ``get_model_state_dict`` / ``get_optimizer_state_dict`` (``full_state_dict`` per case) are
    keyed by the unwrapped model's FQNs (full: values equal the unsharded model's and Adam's);
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` with the same options into a fresh
    wrapped model and Adam, then one more step, give the unsharded model's parameters. With
    ``use_orig_params=True`` (per case) and without it."""
    dsd = _dsd()
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = _shard1(ctx, copy.deepcopy(oracle), orig)
    wrapped = torch.compiler.disable(model)
    assert all(k.startswith("_orig_mod.") for k in wrapped.state_dict()), (
        f"{ctx.where()} precondition: the wrapper's own keys {sorted(wrapped.state_dict())}"
    )
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, wrapped, opt, step)
    opts = dsd.StateDictOptions(full_state_dict=full)
    names = sorted(oracle.state_dict())
    msd = dsd.get_model_state_dict(wrapped, options=opts)
    assert sorted(msd) == names, f"{ctx.where()} model keys {sorted(msd)}, expected {names}"
    osd = dsd.get_optimizer_state_dict(wrapped, opt, options=opts)
    if full:
        for fqn, value in msd.items():
            assert_close(ctx, f"full {fqn}", value, oracle.state_dict()[fqn], FP32["param"])

        def no_shards(name, key, value, full_value):
            raise AssertionError(f"{ctx.where()} {name}.{key}: expected a full tensor")

        assert_state(ctx, osd, oracle, oopt, True, "wrapped FSDP1 optimizer", no_shards)
    else:
        params = sorted(n for n, _ in oracle.named_parameters())
        assert sorted(osd["state"]) == params, (
            f"{ctx.where()} sharded optimizer state keys {sorted(osd['state'])}, expected {params}"
        )
    ctx.seed(5)
    fresh = _shard1(ctx, InnerHeadNet().to(ctx.device), orig)
    fwrapped = torch.compiler.disable(fresh)
    fopt = torch.optim.Adam(fwrapped.parameters(), lr=1e-2)
    dsd.set_model_state_dict(fwrapped, msd, options=opts)
    dsd.set_optimizer_state_dict(fwrapped, fopt, osd, options=opts)
    _step(ctx, oracle, oopt, STEPS)
    _step(ctx, fwrapped, fopt, STEPS)
    got = full_params(ctx, fresh)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} one step after the load", got[name], ref, FP32["param"])
