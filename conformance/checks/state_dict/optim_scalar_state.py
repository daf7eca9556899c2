"""Area "state_dict": a Python scalar in a parameter's optimizer state (an ``int`` step count, a
``float``) survives FSDP1's FULL optimizer state dict loaded with ``rank0_only=True`` as it does
with ``rank0_only=False`` (S63).

The optimizer is ``_ScalarStateSGD``, SGD with momentum whose per-parameter state holds ``step``
as a Python ``int`` and ``scale`` as a Python ``float`` next to its ``momentum_buffer`` tensor. The
oracle is an unsharded copy of the model stepped by the same optimizer on the same batch (every
rank feeds the same batch, so the averaged gradient is the oracle's): every rank's loaded state
holds the oracle's ``step`` and ``scale``, and equals what the ``rank0_only=False`` load gives.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.checks._shared.fsdp1_setup import _batch, _kwargs
from conformance.checks.state_dict.optim_load_forms import REQUIRES, _same_state
from conformance.checks.state_dict.optim_state_consistency import _full_optim
from conformance.registry import check

STEPS = 2


class _ScalarStateSGD(torch.optim.Optimizer):
    """SGD with momentum 0.9; each parameter's state: ``step`` (int), ``scale`` (float, the
    momentum raised to ``step``) and ``momentum_buffer``."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                state["scale"] = 0.9 ** state["step"]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def _scalars(state):
    return {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}


@check(
    area="state_dict",
    requires=REQUIRES,
    cases={"orig_params": {"use_orig_params": True}, "flat": {"use_orig_params": False}},
    world_sizes=(1, 2, 3),
)
def fsdp1_optim_load_rank0_only_scalar_state(ctx, use_orig_params):
    """S63: one unit over ``Linear(4, 4)`` stepped twice by ``_ScalarStateSGD`` (per-parameter
    state ``step``: Python int, ``scale``: Python float, ``momentum_buffer``): its FULL
    ``optim_state_dict`` passed by rank 0 to ``optim_state_dict_to_load`` under
    ``FullOptimStateDictConfig(rank0_only=True)`` (the others ``{}``) gives every rank the state
    the ``rank0_only=False`` call gives, whose ``step`` and ``scale`` are the unsharded
    optimizer's, of the same Python types (``use_orig_params`` True and False)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Linear(4, 4).to(ctx.device)
    ref = copy.deepcopy(plain)
    model = fsdp(plain, use_orig_params=use_orig_params, **_kwargs(ctx))
    opt, ref_opt = _ScalarStateSGD(model.parameters()), _ScalarStateSGD(ref.parameters())
    for step in range(STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(_batch(ctx, 630 + step)).square().mean().backward()
            o.step()
            o.zero_grad()
    want = [_scalars(ref_opt.state[p]) for p in ref.parameters()]
    assert want[0] == {"step": STEPS, "scale": 0.9**STEPS} and all(w == want[0] for w in want), (
        f"{ctx.where()} oracle precondition: the unsharded optimizer's scalars are {want}"
    )
    want = want[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _full_optim(ctx, model):
            osd = fsdp.optim_state_dict(model, opt)
            both = fsdp.optim_state_dict_to_load(model, opt, copy.deepcopy(osd))
        with _full_optim(ctx, model, rank0_only=True):
            got = fsdp.optim_state_dict_to_load(
                model, opt, copy.deepcopy(osd) if ctx.rank == 0 else {}
            )
    state = got.get("state", {}) if isinstance(got, dict) else {}
    for key, entry in state.items():
        scalars = _scalars(entry)
        assert scalars == want, (
            f"{ctx.where()} rank0_only load: state[{key!r}] scalars {scalars}, expected the "
            f"unsharded optimizer's {want}"
        )
        for name, value in want.items():
            assert type(scalars[name]) is type(value), (
                f"{ctx.where()} rank0_only load: state[{key!r}][{name!r}] is a "
                f"{type(scalars[name]).__name__}, expected {type(value).__name__}"
            )
    _same_state(ctx, "rank0_only load vs rank0_only=False load", state, both["state"])
