"""Area "fsdp1_runtime": the module that defines FSDP1's configuration types (R11), and ``apply``
on a unit that is not the root (R117).

[Note: the api module]
``torch.distributed.fsdp.api`` is where upstream defines FSDP1's configuration types; its
``__all__`` names exactly the fourteen of ``API_ALL`` (R11), so ``from <ns>.api import *`` gives
them, and each is the class the namespace exports under the same name.

[Note: apply on a nested unit]
``apply(fn)`` needs the unit's parameters unsharded, which may initialise the unit lazily before
any forward; called on a unit that will be a non-root (it sits inside another unit), that must
leave nothing that makes it a root: the tree's first forward then runs from the true root and
equals the unsharded model given the same ``fn`` (R117).
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _batch, _kwargs
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check

API_ALL = (
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
)


@check(area="fsdp1_runtime", requires={base.FSDP1_API}, world_sizes=(1,))
def api_module_exports(ctx):
    """R11: the namespace's ``api`` module lists exactly FSDP1's fourteen configuration types in
    ``__all__`` (``from <ns>.api import *`` gives them), and each is the namespace's class of
    that name where the namespace exports it."""
    ns = ctx.impl.ns
    try:
        api = importlib.import_module(f"{ns.__name__}.api")
    except ModuleNotFoundError as exc:
        raise base.NotSupported(f"no {ns.__name__}.api module ({exc})") from exc
    got = sorted(getattr(api, "__all__", ()))
    assert got == sorted(API_ALL), (
        f"{ctx.where()} {api.__name__}.__all__ is {got}, expected {sorted(API_ALL)}"
    )
    star: dict = {}
    exec(f"from {api.__name__} import *", star)  # noqa: S102 - the import users write
    assert sorted(k for k in star if not k.startswith("__")) == sorted(API_ALL), (
        f"{ctx.where()} 'from {api.__name__} import *' gives "
        f"{sorted(k for k in star if not k.startswith('__'))}"
    )
    for name in API_ALL:
        exported = getattr(ns, name, None)
        assert exported is None or exported is getattr(api, name), (
            f"{ctx.where()} {ns.__name__}.{name} is not {api.__name__}.{name}"
        )


def _fill(m: nn.Module) -> None:
    """Rank-independent values for each Linear's weight and bias (an in-place write)."""
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(-1, 1, m.weight.numel()).reshape(m.weight.shape))
            m.bias.fill_(0.25)


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def apply_on_nested_unit_first(ctx):
    """R117: ``inner.apply(fn)`` on the nested unit of ``FSDP(Sequential(inner, Linear(4, 4)))``
    (``inner = FSDP(Linear(4, 4))``) before any forward, ``fn`` writing rank-independent values
    into each Linear's weight and bias: the root's first forward (the same batch on every rank)
    then runs and equals the unsharded ``Sequential`` to which ``fn`` was applied on its first
    Linear, and so do the reassembled parameters."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    shadow = copy.deepcopy(oracle)
    inner = fsdp(shadow[0], **_kwargs(ctx))
    model = fsdp(nn.Sequential(inner, shadow[1]), **_kwargs(ctx))
    inner.apply(_fill)
    oracle[0].apply(_fill)
    x = _batch(ctx, 117)
    assert_close(ctx, "root's first forward after inner.apply", model(x), oracle(x), FP32["loss"])
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after inner.apply", got[name], ref, FP32["param"])
