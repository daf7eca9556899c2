"""Area "fsdp1_runtime": FSDP1 edges around the flat parameter and the constructor (R63-R70).

[Note: small promises at the edges of the flat parameter]
* ``FSDP_USE_FULL_PREC_IN_EVAL=1`` also covers a ``MixedPrecision`` without ``param_dtype``
  (only ``reduce_dtype`` and ``buffer_dtype``): in ``eval()`` mode the buffers are in full
  precision and the gradients are reduced in full precision, so an eval-mode backward gives the
  unsharded fp32 model's gradients (R63).
* With ``use_orig_params=True`` an original parameter whose ``.data`` the user replaced (same
  shape) is written back silently at the default debug level: no warning, and the next forward
  computes with the new values (R64).
* With ``use_orig_params=False`` the exposed flat parameter's ``.data`` replaced by a tensor one
  element short is refused at the next forward with AssertionError naming the expected and the
  actual size (R65).
* A unit that got a gradient inside ``no_sync()`` and is not used by the next, synced backward
  never ends up with a gradient of its unsharded size: upstream refuses that backward (R66).
* ``ignored_modules`` that FSDP1 cannot hold as a set of modules (an int, a list with an unhashable
  module) is refused with TypeError (R67).
* ``sync_module_states=True`` treats a tensor-subclass buffer (``TwoTensor``) as its inner
  tensors: refused for CPU states as R61 says, or broadcast, never left per rank (R68).
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fsdp1.runtime_edges import _BufBody, _EmptyRoot
from conformance.checks.fsdp1.summon_full_params import TwoUnits, visible
from conformance.checks.fsdp1.training import assert_orig_param_grads
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}
B = 2


def _kwargs(ctx):
    return {"device_id": torch.device("cpu")} if ctx.device.type == "cpu" else {}


def _x(ctx, n_in: int, salt: int) -> torch.Tensor:
    """The same batch on every rank (so the averaged gradient is the oracle's on it)."""
    return torch.randn(B, n_in, generator=torch.Generator().manual_seed(salt)).to(ctx.device)


# ------------------------------------------------------------------------------ R63
@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.MIXED_PRECISION, base.FSDP1_FULL_PREC_IN_EVAL},
    world_sizes=(1, 2),
)
def full_precision_in_eval_without_param_dtype(ctx):
    """R63: ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at construction with
    ``MixedPrecision(reduce_dtype=bf16, buffer_dtype=bf16)`` (no ``param_dtype``) on ``body`` and
    on the tensor-less root (``use_orig_params=True``): the buffer is bf16 in a ``train()`` forward,
    fp32 in an ``eval()`` one, bf16 again after ``train()``; an eval-mode forward and backward
    (the same batch on every rank) gives every parameter the unsharded fp32 model's gradient
    within fp32 tolerance (reduced in fp32, not rounded to bf16)."""
    ctx.seed(0)
    oracle = _EmptyRoot().to(ctx.device)
    mp = dict(reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    old = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL")
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        model = ctx.impl.shard(
            copy.deepcopy(oracle),
            ctx,
            plan=[("body", {}), ("", {})],
            mixed_precision=mp,
            use_orig_params=True,
        )
    finally:
        if old is None:
            del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
        else:
            os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = old
    body = next(m for m in model.modules() if isinstance(m, _BufBody))
    seen: list[torch.dtype] = []
    body.register_forward_pre_hook(lambda m, args: seen.append(m.shift.dtype))
    x = _x(ctx, 4, 7)
    for mode, dtype in (
        ("train", torch.bfloat16),
        ("eval", torch.float32),
        ("train", torch.bfloat16),
    ):
        getattr(model, mode)()
        seen.clear()
        with torch.no_grad():
            model(x)
        assert seen == [dtype], (
            f"{ctx.where()} forward in {mode}() mode: buffer dtype {seen}, expected {dtype}"
        )
    model.eval()
    oracle.eval()
    model(x).square().sum().backward()
    oracle(x).square().sum().backward()
    assert_orig_param_grads(ctx, model, oracle, "eval-mode backward, no param_dtype")


# ------------------------------------------------------------------------------ R64
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def writeback_silent_by_default(ctx):
    """R64: ``use_orig_params=True`` at the default debug level (``TORCH_DISTRIBUTED_DEBUG``
    OFF): ``head.weight.data`` replaced outside forward by a tensor of its (sharded) shape holding
    0.5 is written back without any warning (none says "writeback"), and the next forward equals
    the unsharded model whose ``head.weight`` is all 0.5."""
    old_level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        ctx.seed(0)
        oracle = TwoUnits().to(ctx.device)
        model = ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})], use_orig_params=True
        )
        p = visible(ctx, model)["head.weight"]
        with torch.no_grad():
            p.data = torch.full_like(p, 0.5)
            oracle.head.weight.fill_(0.5)
        x = _x(ctx, 5, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                out = model(x)
    finally:
        dist.set_debug_level(old_level)
    said = [str(w.message)[:120] for w in caught if "writeback" in str(w.message).lower()]
    assert not said, f"{ctx.where()} a writeback at debug level OFF warned: {said}"
    with torch.no_grad():
        assert_close(ctx, "forward after head.weight.data = 0.5s", out, oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R65
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def flat_param_data_wrong_size(ctx):
    """R65: ``use_orig_params=False`` at world size 1 over ``Linear(4, 4)``: the exposed flat
    parameter (20 elements) whose ``.data`` is replaced by 19 zeros is refused at the next forward
    with AssertionError naming the expected size 20 and the actual 19."""
    ctx.seed(0)
    model = ctx.impl.shard(nn.Linear(4, 4).to(ctx.device), ctx)
    (flat,) = list(model.parameters())
    n = 4 * 4 + 4
    assert flat.numel() == n, f"{ctx.where()} test setup: flat parameter of {flat.numel()}"
    with torch.no_grad():
        flat.data = torch.zeros(n - 1, device=flat.device, dtype=flat.dtype)
    expect_error(
        ctx,
        f"forward after the flat parameter's .data got {n - 1} elements",
        AssertionError,
        rf"\b{n}\b.*\b{n - 1}\b",
        lambda: model(_x(ctx, 4, 9)),
    )


# ------------------------------------------------------------------------------ R67
class _Unhashable(nn.Linear):
    """A Linear that defines ``__eq__`` alone, so Python makes its instances unhashable."""

    def __eq__(self, other):
        return self is other


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def ignored_modules_not_a_module_set(ctx):
    """R67: ``ignored_modules`` that FSDP1 cannot hold as a set of modules is refused at
    construction with TypeError: an int (not iterable) with a message naming ``int``, a list
    holding an unhashable module (its class defines ``__eq__`` alone) with a message naming
    ``ignored_modules``."""
    ns = ctx.impl.ns
    for what, bad, pattern in (
        ("ignored_modules=3", 3, r"\bint\b"),
        ("ignored_modules=[an unhashable Linear]", [_Unhashable(4, 4)], r"ignored_modules"),
    ):
        expect_error(
            ctx,
            what,
            TypeError,
            pattern,
            lambda bad=bad: ns.FullyShardedDataParallel(
                nn.Linear(4, 4).to(ctx.device), ignored_modules=bad, **_kwargs(ctx)
            ),
        )


# ------------------------------------------------------------------------------ R68
class _SubclassBuffer(nn.Module):
    """No parameter; a buffer ``pair``, a ``TwoTensor`` (a tensor subclass holding two (3,)
    tensors ``a`` and ``b``), added to the input."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        self.register_buffer("pair", TwoTensor(torch.randn(3), torch.randn(3)))

    def forward(self, x):
        return x + self.pair


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(2,))
def sync_module_states_subclass_buffer(ctx):
    """R68: ``sync_module_states=True`` on a module whose only state is a tensor-subclass buffer
    (``TwoTensor``), rank r adding r to both inner tensors: either every rank holds rank 0's
    inner tensors after construction, or (some state on the CPU) construction is refused with
    ValueError naming ``sync_module_states=True`` (R61); never a unit that kept a rank's own
    values."""
    ctx.seed(0)
    mine = _SubclassBuffer().to(ctx.device)
    want = {k: getattr(mine.pair, k).clone() for k in ("a", "b")}  # rank 0's: same seed
    with torch.no_grad():
        for k in ("a", "b"):
            getattr(mine.pair, k).add_(float(ctx.rank))
    try:
        unit = ctx.impl.ns.FullyShardedDataParallel(mine, sync_module_states=True, **_kwargs(ctx))
    except ValueError as exc:
        assert mine.pair.device.type == "cpu", (
            f"{ctx.where()} sync_module_states=True refused a module on {mine.pair.device}: {exc}"
        )
        assert "sync_module_states=True" in str(exc), (
            f"{ctx.where()} the refusal {str(exc)[:300]!r} does not name sync_module_states=True"
        )
        return
    (pair,) = [b for n, b in unit.named_buffers() if n.endswith("pair")]
    for k, ref in want.items():
        assert_close(
            ctx, f"buffer pair.{k} after the broadcast", getattr(pair, k), ref, FP32["param"]
        )


# ------------------------------------------------------------------------------ R66
class _Skippable(nn.Module):
    """``head(inner(x))``, or ``head(x)`` alone when called with ``use_inner=False``."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x, use_inner: bool = True):
        return self.head(self.inner(x) if use_inner else x)


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(2,))
def no_sync_then_unit_unused(ctx):
    """R66: FULL_SHARD at ws 2, ``inner`` its own unit: a backward inside ``model.no_sync()``
    that uses ``inner``, then a synced forward and backward that does not: the synced backward is
    either refused with AssertionError (upstream: the unit's no_sync gradient was never reduced),
    or it completes and every flat parameter's gradient, where there is one, has the shape of the
    rank's shard (never the unit's unsharded size)."""
    ctx.seed(0)
    model = ctx.impl.shard(_Skippable().to(ctx.device), ctx, plan=[("inner", {}), ("", {})])
    x = _x(ctx, 4, 10)
    with model.no_sync():
        model(x).sum().backward()
    try:
        model(x, use_inner=False).sum().backward()
    except AssertionError:
        return
    shards = {tuple(fqns): flat.shape for fqns, flat in ctx.impl.flat_shards(model)}
    for fqns, grad in ctx.impl.flat_grads(model):
        assert grad is None or grad.shape == shards[tuple(fqns)], (
            f"{ctx.where()} after a no_sync backward and a synced one without inner: the flat "
            f"gradient of {fqns} is {tuple(grad.shape)}, the shard {tuple(shards[tuple(fqns)])}"
        )
