"""Area "fsdp1_runtime": original parameters, device moves, subclass sync and sparse unscale
(R75-R78), and the flat parameter of frozen original parameters in a first LOCAL state dict (R81).

[Note: the flat parameter follows its original parameters]
* With ``use_orig_params=True`` the original parameters are views into the flat parameter, and
  whether the flat parameter needs a gradient follows them: when every original parameter has
  been frozen (``requires_grad_(False)``) the next forward's output does not require grad, as
  the unsharded model's would not; unfrozen again, a backward gives the unsharded model's
  gradients (R75).
* ``device_id=torch.device("cpu")`` names the device the module should live on: a module already
  there needs no move and draws no warning about being initialised on the CPU (R76).
* ``sync_module_states=True`` treats a tensor-subclass *parameter* (``TwoTensor``) as its inner
  tensors, as R68 does for a buffer: refused for CPU states as R61 says, or broadcast, never left
  per rank (R77).
* ``ShardedGradScaler.unscale_`` handles a sparse float32 gradient (``nn.Embedding(sparse=True)``)
  like a dense one: the gradient stays float32 (and sparse) and is divided by the scale (R78).
* A ``LOCAL_STATE_DICT`` taken as the very first use of a unit whose original parameters were all
  frozen after wrapping holds a flat shard that does not require grad (the flat parameter follows
  its original parameters, R75, from the state dict on, not only from the next forward), with S7's
  values: elements ``[r*ceil(N/ws), ...)`` of the parameters flattened in registration order
  (R81).
"""

from __future__ import annotations

import copy
import importlib
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs, _x
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import first_error_everywhere
from conformance.checks.fsdp1.training import assert_orig_param_grads
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# ------------------------------------------------------------------------------ R75
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def freeze_all_orig_params(ctx):
    """R75: ``use_orig_params=True``, one unit, every original parameter frozen after wrapping
    (``requires_grad_(False)``): a forward's output does not require grad (as the unsharded
    model's does not). On a fresh unit frozen alike, a forward whose input requires grad and its
    backward give the input the frozen unsharded model's gradient and no parameter a gradient;
    after unfreezing them all, a forward and backward gives every original parameter the
    unsharded model's gradient."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = _Mlp().to(ctx.device)
    x = _x(ctx, 4, 31)

    def wrap_frozen():
        model = ns.FullyShardedDataParallel(
            copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx)
        )
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    out = wrap_frozen()(x)
    assert not out.requires_grad, (
        f"{ctx.where()} every original parameter frozen, yet the forward's output requires grad "
        "(the unsharded model's does not)"
    )
    with torch.no_grad():
        assert_close(ctx, "frozen forward", out, oracle(x), FP32["loss"])

    # (a fresh unit: upstream keeps a frozen forward's reshard hook until a backward runs)
    model = wrap_frozen()
    for p in oracle.parameters():
        p.requires_grad_(False)
    xg, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model(xg).sum().backward()
    oracle(xo).sum().backward()
    assert_close(ctx, "input gradient with every parameter frozen", xg.grad, xo.grad, FP32["grad"])
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert not got, f"{ctx.where()} frozen parameters got gradients: {sorted(got)}"

    for p in [*model.parameters(), *oracle.parameters()]:
        p.requires_grad_(True)
    out = model(x)
    assert out.requires_grad, f"{ctx.where()} parameters unfrozen, the output needs no grad"
    out.sum().backward()
    oracle(x).sum().backward()
    assert_orig_param_grads(ctx, model, oracle, "after freezing and unfreezing every parameter")


# ------------------------------------------------------------------------------ R76
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def cpu_device_id_no_cpu_warning(ctx):
    """R76: ``FullyShardedDataParallel(m, device_id=torch.device("cpu"))`` with ``m`` on the CPU
    emits no warning that the passed-in module is on the CPU (the device was named; there is
    nothing to recommend)."""
    if ctx.device.type != "cpu":
        return  # the rule is about device_id naming the CPU
    ctx.seed(0)
    module = _Mlp()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ctx.impl.ns.FullyShardedDataParallel(module, device_id=torch.device("cpu"))
    bad = [
        str(w.message)
        for w in seen
        if "on cpu" in str(w.message).lower() and "module" in str(w.message).lower()
    ]
    assert not bad, (
        f"{ctx.where()} device_id=cpu with the module on the CPU warned: {bad[0][:300]!r}"
    )


# ------------------------------------------------------------------------------ R77
class _SubclassParam(nn.Module):
    """A single parameter that is a ``TwoTensor`` (a wrapper subclass holding ``a`` and ``b``)."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        self.w = nn.Parameter(TwoTensor(torch.randn(4), torch.randn(4)))

    def forward(self, x):
        return x * self.w


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(2,))
def sync_module_states_subclass_param(ctx):
    """R77: ``sync_module_states=True`` on a module whose only state is a tensor-subclass
    parameter (``TwoTensor``), rank r adding r to both inner tensors: construction is refused
    with ValueError naming ``sync_module_states=True`` (some state on the CPU, R61), or every rank
    holds rank 0's inner tensors after it; never a unit that kept a rank's own values."""
    ctx.seed(0)
    mine = _SubclassParam().to(ctx.device)
    want = {k: getattr(mine.w, k).detach().clone() for k in ("a", "b")}  # rank 0's: same seed
    with torch.no_grad():
        for k in ("a", "b"):
            getattr(mine.w, k).add_(float(ctx.rank))
    orig = mine.w  # the broadcast writes into the module's own parameter, before flattening
    try:
        ctx.impl.ns.FullyShardedDataParallel(mine, sync_module_states=True, **_kwargs(ctx))
    except ValueError as exc:
        assert ctx.device.type == "cpu", (
            f"{ctx.where()} sync_module_states=True refused a module on {ctx.device}: {exc}"
        )
        assert "sync_module_states=True" in str(exc), (
            f"{ctx.where()} the refusal {str(exc)[:300]!r} does not name sync_module_states=True"
        )
        return
    for k, ref in want.items():
        assert_close(
            ctx, f"parameter w.{k} after the broadcast", getattr(orig, k), ref, FP32["param"]
        )


# ------------------------------------------------------------------------------ R78
class _SparseEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 3, sparse=True)

    def forward(self, idx):
        return self.emb(idx)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_GRAD_SCALER},
    world_sizes=(1,),
)
def grad_scaler_sparse_unscale(ctx):
    """R78: ``ShardedGradScaler(init_scale=16).unscale_(opt)`` over an optimizer holding a
    parameter with a sparse float32 gradient (scaled as a loss times 16 gives it) leaves that
    gradient float32 and equal to the unscaled one (the scaled gradient divided by 16), and
    records no inf."""
    ns = ctx.impl.ns
    scaler_mod = importlib.import_module(f"{ns.__name__}.sharded_grad_scaler")
    ctx.seed(0)
    model = _SparseEmbed().to(ctx.device)
    idx = torch.tensor([0, 2, 2, 5], device=ctx.device)
    # the unscaled gradient, from the plain module
    model(idx).pow(2).sum().backward()
    want = model.emb.weight.grad.to_dense().clone()
    model.emb.weight.grad = None
    scaler = scaler_mod.ShardedGradScaler(device=ctx.device.type, init_scale=16.0)
    scaler.scale(model(idx).pow(2).sum()).backward()
    assert model.emb.weight.grad.is_sparse
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    grad = model.emb.weight.grad
    assert grad.dtype == torch.float32, (
        f"{ctx.where()} unscale_ turned a float32 sparse gradient into {grad.dtype}"
    )
    assert_close(ctx, "sparse gradient after unscale_", grad.to_dense(), want, FP32["grad"])


# ------------------------------------------------------------------------------ R81
@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.LOCAL_STATE_DICT, base.FSDP1_LOCAL_ORIG_PARAMS},
    world_sizes=(2,),
)
def local_state_dict_first_frozen(ctx):
    """R81: ``use_orig_params=True``, one unit over ``Sequential(Linear(4, 4), Linear(4, 4))``,
    every original parameter frozen after wrapping; a LOCAL state dict as the unit's first use:
    ``_flat_param``'s local shard does not require grad and equals elements
    ``[r*ceil(N/ws), min((r+1)*ceil(N/ws), N))`` of the parameters flattened in registration
    order (N = 40)."""
    ctx.seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(plain), ctx, use_orig_params=True)
    for p in model.parameters():
        p.requires_grad_(False)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "local"))
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in plain.parameters()])
    start, end, _ = flat_range(flat.numel(), ctx.world_size, ctx.rank)
    entry = sd.get("_flat_param")
    assert entry is not None and hasattr(entry, "local_shards"), (
        f"{ctx.where()} _flat_param: {type(entry).__name__}, expected a ShardedTensor "
        f"(keys {sorted(sd)})"
    )
    shards = entry.local_shards()
    assert len(shards) == (1 if end > start else 0), (
        f"{ctx.where()} _flat_param: {len(shards)} local shard(s) for elements {start}:{end}"
    )
    for shard in shards:
        local = shard.tensor
        assert not local.requires_grad, (
            f"{ctx.where()} every parameter frozen before the first state_dict(), yet the local "
            "flat shard requires grad"
        )
        assert torch.equal(local.detach().cpu(), flat[start:end]), (
            f"{ctx.where()} _flat_param local shard {local.detach().cpu().tolist()[:6]}..., "
            f"expected elements {start}:{end} of the flattened parameters"
        )
