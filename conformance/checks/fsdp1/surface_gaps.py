"""Area "fsdp1_runtime": FSDP1's constructor, names, state-dict hooks, optimizer state and clipping
at the edges a mutation campaign found unchecked (R83-R89).

[Note: small promises on FSDP1's surface]
* ``device_id`` names the compute device; when the module's parameters are not there after
  construction moved and materialised them (a meta module whose ``param_init_fn`` does nothing),
  or when the CPU is named with an index (``cpu:0``, which is not the CPU compute device ``cpu``),
  construction is refused with ValueError naming both devices (R83).
* A module may override ``named_parameters`` without supporting ``remove_duplicate=False``
  (asserting it is True, as some wrappers do): FSDP1 still wraps it, its state dict holds the
  unsharded model's entries, and its forward is the unsharded model's (R84).
* ``named_buffers()`` of an FSDP1 module names its buffers as ``nn.Module`` does (through the
  ``_fsdp_wrapped_module.`` attribute) outside ``summon_full_params``, and by the unwrapped
  module's FQNs inside it (R85).
* A ``state_dict`` post-hook of the wrapped module that removes a managed parameter's key makes
  ``state_dict()`` (FULL and SHARDED) fail with an error that says so: it names the missing key and
  the state dict, rather than a bare ``KeyError`` from deep inside (R86).
* An optimizer state of a ``use_orig_params=False`` unit whose flat parameter holds one original
  parameter saves and loads as any other: after ``optim_state_dict_to_load`` into a fresh model and
  Adam, the optimizer holds the unsharded Adam's state and a further step gives its parameters
  (R87).
* ``summon_full_params(with_grads=True)`` on a unit none of whose ranks holds a gradient shows no
  gradient on any original parameter, even one whose ``.grad`` the user assigned while it holds
  no element on its rank (such a gradient carries nothing into the flat gradient) (R88).
* ``clip_grad_norm_`` on sharded units takes ``max_norm`` as anything ``float()`` accepts (the
  string ``"0.5"``), as ``torch.nn.utils.clip_grad_norm_`` does (R89).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.optim_state import assert_state
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.checks.fsdp1.clip_grad_arguments import REL_TOL
from conformance.checks.fsdp1.clip_grad_norm import CLIP, full_grads, oracle_clip
from conformance.checks.fsdp1.flat_param_gaps import _kwargs
from conformance.checks.fsdp1.training import assert_params_equal_oracle
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _global_batch(ctx, salt: int) -> torch.Tensor:
    """``ws * B`` samples of 4 features, the same on every rank."""
    g = torch.Generator().manual_seed(salt)
    return torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)


def _compute_device(ctx) -> torch.device:
    """The compute device with its index where it has one (``cuda:0``; the CPU is ``cpu``)."""
    if ctx.device.type == "cpu":
        return torch.device("cpu")
    if ctx.device.index is not None:
        return ctx.device
    return torch.device(ctx.device.type, torch.get_device_module(ctx.device.type).current_device())


# ------------------------------------------------------------------------------ R83
DEVICE_CASES = {"meta-left": {"meta": True}, "cpu-with-index": {"meta": False}}


@check(area="fsdp1_runtime", requires=REQUIRES, cases=DEVICE_CASES, world_sizes=(1,))
def device_id_inconsistent(ctx, meta):
    """R83: construction is refused with ValueError whose message says the compute device and
    ``device_id`` are inconsistent and names both: ``meta-left``, a ``Linear(3, 3)`` built on the
    meta device with ``param_init_fn=lambda m: None`` (so its parameters stay on meta) and
    ``device_id`` the compute device; ``cpu-with-index`` (CPU only), a ``Linear(3, 3)`` on the CPU
    with ``device_id=torch.device("cpu", 0)`` (the CPU compute device is ``cpu``, no index)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    if meta:
        device_id, held = _compute_device(ctx), torch.device("meta")
        with torch.device("meta"):
            module = nn.Linear(3, 3)
        options = {"param_init_fn": lambda m: None}
    else:
        if ctx.device.type != "cpu":
            return  # the case is about the CPU named with an index
        device_id, held = torch.device("cpu", 0), torch.device("cpu")
        module, options = nn.Linear(3, 3), {}
    pattern = rf"(?is)inconsistent.*{re.escape(str(held))}\b.*{re.escape(str(device_id))}\b"
    expect_error(
        ctx,
        f"parameters on {held} with device_id={device_id}",
        ValueError,
        pattern,
        lambda: fsdp(module, device_id=device_id, **options),
    )


# ------------------------------------------------------------------------------ R84
class _StrictNames(nn.Linear):
    """A Linear whose ``named_parameters`` refuses ``remove_duplicate=False``."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        assert remove_duplicate, "this module only names parameters without duplicates"
        return super().named_parameters(prefix, recurse)


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FULL_STATE_DICT}, world_sizes=(1, 2))
def named_parameters_without_remove_duplicate(ctx):
    """R84: FSDP1 (one unit) over ``Sequential(M(4, 4), Linear(4, 2))``, where ``M`` is a Linear
    whose ``named_parameters`` asserts ``remove_duplicate`` is True, constructs; its FULL state
    dict has exactly the keys ``0.weight``, ``0.bias``, ``1.weight``, ``1.bias`` with the unsharded
    model's values, and a forward (the same batch on every rank) equals the unsharded model's."""
    ctx.seed(0)
    oracle = nn.Sequential(_StrictNames(4, 4), nn.Linear(4, 2)).to(ctx.device)
    model = first_error_everywhere(ctx, lambda: ctx.impl.shard(copy.deepcopy(oracle), ctx))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = ctx.impl.state_dict(model, "full")
    want = {k: v.detach() for k, v in nn.Module.state_dict(oracle).items()}
    assert sorted(sd) == sorted(want), (
        f"{ctx.where()} FULL state dict keys {sorted(sd)}, expected {sorted(want)}"
    )
    for key, value in want.items():
        assert_close(ctx, f"FULL state dict {key}", sd[key].detach(), value, FP32["param"])
    x = _global_batch(ctx, 83)
    with torch.no_grad():
        assert_close(ctx, "forward", model(x), oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R85
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def named_buffers_in_summon(ctx):
    """R85: over one unit of ``Sequential(Linear(4, 4), BatchNorm1d(4))``, ``named_buffers()``
    gives, in the unwrapped module's order, ``_fsdp_wrapped_module.`` + each of its buffer names
    outside ``summon_full_params`` and the unwrapped names (``1.running_mean``, ...) inside it;
    the buffers are the same tensors either way."""
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(ctx.device)
    names = [n for n, _ in plain.named_buffers()]
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model = fsdp(plain, **_kwargs(ctx))
    outside = list(model.named_buffers())
    want = [f"_fsdp_wrapped_module.{n}" for n in names]
    assert [n for n, _ in outside] == want, (
        f"{ctx.where()} named_buffers() outside summon_full_params: "
        f"{[n for n, _ in outside]}, expected {want}"
    )
    with fsdp.summon_full_params(model):
        inside = list(model.named_buffers())
    assert [n for n, _ in inside] == names, (
        f"{ctx.where()} named_buffers() inside summon_full_params: {[n for n, _ in inside]}, "
        f"expected the unwrapped module's {names}"
    )
    for (name, a), (_, b) in zip(outside, inside):
        assert a is b, f"{ctx.where()} buffer {name}: a different tensor inside summon_full_params"


# ------------------------------------------------------------------------------ R86
def _drop_weight(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "weight")


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"full": {"kind": "full"}, "sharded": {"kind": "sharded"}},
    world_sizes=(1, 2),
)
def state_dict_hook_drops_param(ctx, kind):
    """R86: ``Linear(4, 2)`` with a ``state_dict`` post-hook that pops ``prefix + "weight"``,
    wrapped as one unit: ``state_dict()`` under FULL and SHARDED raises on every rank an error (of
    any type) whose message names the missing key ``weight`` and says ``state_dict`` (a bare
    ``KeyError('weight')`` does not)."""
    ctx.require({"full": base.FULL_STATE_DICT, "sharded": base.SHARDED_STATE_DICT}[kind])
    ctx.seed(0)
    lin = nn.Linear(4, 2).to(ctx.device)
    lin.register_state_dict_post_hook(_drop_weight)
    model = ctx.impl.ns.FullyShardedDataParallel(lin, **_kwargs(ctx))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = ctx.impl.state_dict(model, kind)
    except Exception as exc:  # noqa: BLE001 - any type, judged by its message
        said = str(exc)
        assert re.search(r"\bweight\b", said) and "state_dict" in said, (
            f"{ctx.where()} {kind} state_dict() with weight popped by a post-hook: "
            f"{type(exc).__name__} {said[:300]!r} does not say that weight is missing from the "
            "state_dict"
        )
        return
    raise AssertionError(
        f"{ctx.where()} {kind} state_dict() with weight popped by a post-hook returned "
        f"{sorted(sd)}, expected an error naming the missing weight"
    )


# ------------------------------------------------------------------------------ R87
def _one_param_unit() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_OPTIM_STATE_DICT, base.FULL_STATE_DICT},
    world_sizes=(1, 2),
)
def optim_state_one_param_flat(ctx):
    """R87: ``use_orig_params=False``, units ``0`` (a bias-free ``Linear(4, 4)``: its flat
    parameter holds one original parameter) and the root (``1``); Adam (lr 1e-2), one step on the
    global batch; ``optim_state_dict`` (FULL), then ``optim_state_dict_to_load`` into a fresh such
    model holding the stepped parameters and a fresh Adam, and ``load_state_dict``: that
    optimizer's FULL ``optim_state_dict`` holds the unsharded Adam's ``step``, ``exp_avg`` and
    ``exp_avg_sq`` under each FQN, and one more step on a second batch gives the unsharded
    model's parameters after two steps."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    plan = [("0", {}), ("", {})]
    ctx.seed(0)
    oracle = _one_param_unit().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    oopt = torch.optim.Adam(oracle.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(module, optim, salt):
        module(_global_batch(ctx, salt)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    step(oracle, oopt, 87)
    step(model, opt, 87)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = fsdp.optim_state_dict(model, opt)
    fresh = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)  # the stepped parameters
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = first_error_everywhere(
            ctx, lambda: fsdp.optim_state_dict_to_load(fresh, fopt, osd)
        )
        fopt.load_state_dict(loaded)
        again = fsdp.optim_state_dict(fresh, fopt)
    assert_state(ctx, again, oracle, oopt, True, "loaded into a fresh Adam, saved again", None)
    step(oracle, oopt, 88)
    step(fresh, fopt, 88)
    assert_params_equal_oracle(ctx, fresh, oracle, "after a step of the loaded Adam")


# ------------------------------------------------------------------------------ R88
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(2,))
def summon_with_grads_none_anywhere(ctx):
    """R88: ``use_orig_params=True``, FULL_SHARD, one unit over ``Sequential(Linear(4, 4,
    bias=False), Linear(4, 4, bias=False))`` (rank 0's shard holds ``0.weight``, rank 1's
    ``1.weight``), before any backward: rank 0 sets ``1.weight.grad`` to an empty tensor of its
    (empty) local shape; inside ``summon_full_params(with_grads=True)`` every original
    parameter's ``.grad`` is None on every rank (no rank's unit holds a gradient)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model = ctx.impl.shard(plain.to(ctx.device), ctx, use_orig_params=True)
    inner = model.module
    if ctx.rank == 0:
        p = inner[1].weight
        assert p.numel() == 0, (
            f"{ctx.where()} test setup: 1.weight holds {p.numel()} elements on rank 0, expected 0"
        )
        p.grad = torch.zeros_like(p)
    with fsdp.summon_full_params(model, with_grads=True):
        held = {n: tuple(p.grad.shape) for n, p in inner.named_parameters() if p.grad is not None}
    assert not held, (
        f"{ctx.where()} summon_full_params(with_grads=True) with no gradient on any rank's unit: "
        f"gradients {held}, expected every .grad None"
    )


# ------------------------------------------------------------------------------ R89
@check(area="fsdp1_runtime", requires=CLIP, world_sizes=(2,))
def clip_grad_max_norm_as_string(ctx):
    """R89: FULL_SHARD at ws 2, one unit over ``Sequential(Linear(4, 8), Linear(8, 4))``, a
    backward on rank r's samples: ``clip_grad_norm_("0.5")`` returns the total norm and leaves the
    gradients that ``torch.nn.utils.clip_grad_norm_(grads, 0.5)`` gives on the unsharded
    model's gradients (reassembled from every rank's shards)."""
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx)
    x = _global_batch(ctx, 89) * 4  # gradients well above the max_norm
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    model(x[mine]).square().sum(dim=1).mean().backward()
    oracle(x).square().sum(dim=1).mean().backward()
    before = full_grads(ctx, model, oracle, use_orig_params=False)
    want_norm, want = oracle_clip(before, 0.5, 2.0)
    assert want_norm.item() > 0.5, f"{ctx.where()} test setup: total norm {want_norm.item()}"
    got_norm = model.clip_grad_norm_("0.5")
    assert_close(
        ctx, 'clip_grad_norm_("0.5"): total norm', got_norm.reshape(()), want_norm, REL_TOL
    )
    after = full_grads(ctx, model, oracle, use_orig_params=False)
    for name in want:
        assert_close(
            ctx, f'clip_grad_norm_("0.5"): {name} gradient', after[name], want[name], REL_TOL
        )
