"""Area "state_dict": ``torch.distributed.checkpoint.state_dict`` (DSD) on an FSDP1 model with a
compiled submodule after an uncompiled one (R82).

[Note: DSD over FSDP1 with a compiled submodule inside]
``torch.compile(submodule)`` puts a compiler wrapper (``OptimizedModule``) inside the model: the
FSDP1 model's own parameter names of that submodule carry ``_orig_mod.`` (``1._orig_mod.weight``)
while its siblings' do not (``0.weight``). DSD keys its model and optimizer dicts by the unwrapped
model's FQNs (``1.weight``), and loading renames them back to the names FSDP1 expects for every
parameter that carries the prefix, wherever it sits in the model: a wrapped parameter after any
number of unwrapped ones is renamed all the same. So with ``use_orig_params=True``, after Adam
steps, ``get_optimizer_state_dict`` (``full_state_dict`` or not) loads through
``set_optimizer_state_dict`` into a freshly built model's fresh Adam, which then holds the very
state (``exp_avg``, ``exp_avg_sq``, ``step``) the trained optimizer holds for each parameter; the
full dict equals an unsharded Adam's trained on the same global batch; ``get_model_state_dict`` /
``set_model_state_dict`` round trip the same way, keyed without ``_orig_mod.``, equal to the
unsharded model's.

Upstream (torch 2.13) supports this only with ``use_orig_params=True``: with flat parameters the
load refuses the dict ("Missing optimizer state for parameter '1._orig_mod.bias'"), so only that
form is checked. The compiled submodule uses ``backend="eager"`` (no code generation).
Every rank feeds the same global batch, so FSDP1's average equals the unsharded gradient.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import (
    AREA,
    assert_entry,
    first_error_everywhere,
    full_params,
    is_full_kind,
)
from conformance.checks.state_dict.dsd_fsdp1 import REQUIRES, _dsd, _step
from conformance.checks.state_dict.optim_state import _assert_state
from conformance.registry import check

STEPS = 1
ADAM = ("exp_avg", "exp_avg_sq", "step")


def _plain():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _compiled(ctx, plain):
    """FSDP1 (``use_orig_params=True``, one unit) over ``plain`` with its second child compiled."""
    plain[1] = torch.compile(plain[1], backend="eager")
    return ctx.impl.shard(plain, ctx, plan=[("", {"use_orig_params": True})])


def _names(ctx, model):
    return [ctx.impl.clean_fqn(n) for n, _ in model.named_parameters()]


@check(
    area=AREA,
    requires=REQUIRES,
    cases={"full": {"full": True}, "sharded": {"full": False}},
    world_sizes=(1, 2),
)
def dsd_fsdp1_compiled_submodule(ctx, full):
    """R82: an FSDP1 model (``use_orig_params=True``) ``Sequential(Linear, compiled Linear)``
    after an Adam step: ``get_optimizer_state_dict`` / ``get_model_state_dict``
    (``full_state_dict`` per case) are keyed by the unwrapped model's FQNs (no ``_orig_mod.``)
    with the unsharded model's and Adam's values; ``set_optimizer_state_dict`` /
    ``set_model_state_dict`` load them into a fresh such model and Adam, which then hold, for
    every parameter (the compiled ones after the first uncompiled one too), the trained Adam's
    ``exp_avg`` / ``exp_avg_sq`` / ``step`` and the unsharded model's parameters."""
    dsd = _dsd()
    ctx.seed(0)
    oracle = _plain().to(ctx.device)
    model = _compiled(ctx, copy.deepcopy(oracle))
    own = [n for n, _ in model.named_parameters()]
    assert any("_orig_mod." in n for n in own) and not all("_orig_mod." in n for n in own), (
        f"{ctx.where()} precondition: only the second child's names carry _orig_mod.: {own}"
    )
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(ctx, oracle, oopt, step)
        _step(ctx, model, opt, step)
    opts = dsd.StateDictOptions(full_state_dict=full)
    plain = {k: v.detach().cpu().clone() for k, v in oracle.state_dict().items()}
    names = sorted(n for n, _ in oracle.named_parameters())

    msd = dsd.get_model_state_dict(model, options=opts)
    assert sorted(msd) == sorted(plain), (
        f"{ctx.where()} model keys {sorted(msd)}, expected {sorted(plain)}"
    )
    as_full = full or is_full_kind(ctx, "sharded")
    for fqn, value in msd.items():
        assert_entry(ctx, f"model {fqn}", value, plain[fqn], full=as_full, exact=False)
    osd = dsd.get_optimizer_state_dict(model, opt, options=opts)
    assert sorted(osd["state"]) == names, (
        f"{ctx.where()} optimizer state keys {sorted(osd['state'])}, expected {names}"
    )
    _assert_state(ctx, osd, oracle, oopt, as_full, "get_optimizer_state_dict")

    ctx.seed(5)
    fresh = _compiled(ctx, _plain().to(ctx.device))
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)

    def load():
        dsd.set_model_state_dict(fresh, msd, options=opts)
        dsd.set_optimizer_state_dict(fresh, fopt, osd, options=opts)

    first_error_everywhere(ctx, load)
    got = full_params(ctx, fresh)  # keyed by the fresh model's own names (``1._orig_mod.*``)
    refs = list(oracle.named_parameters())
    assert len(refs) == len(got), f"{ctx.where()} parameters {sorted(got)}"
    for (name, ref), own_name in zip(refs, _names(ctx, fresh)):
        assert_close(ctx, f"{name} after set_model_state_dict", got[own_name], ref, FP32["param"])
    trained = dict(zip(_names(ctx, model), model.parameters()))
    for name, param in zip(_names(ctx, fresh), fresh.parameters()):
        mine, want = fopt.state.get(param, {}), opt.state.get(trained[name], {})
        if not want:  # no local elements of this parameter on this rank: nothing trained here
            assert all(v.numel() == 0 for v in mine.values() if v.dim() > 0), (
                f"{ctx.where()} {name}: state {sorted(mine)} loaded for an empty local piece"
            )
            continue
        for key in ADAM:
            assert key in mine, (
                f"{ctx.where()} {name}: no {key} after set_optimizer_state_dict "
                f"(loaded keys {sorted(mine)})"
            )
            assert torch.equal(mine[key].detach().cpu(), want[key].detach().cpu()), (
                f"{ctx.where()} {name}.{key} after set_optimizer_state_dict: "
                f"{mine[key].reshape(-1)[:4].tolist()}, expected the trained "
                f"{want[key].reshape(-1)[:4].tolist()}"
            )
