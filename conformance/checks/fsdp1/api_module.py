"""Area "fsdp1_runtime": the module that defines FSDP1's configuration types.

[Note: the api module]
``torch.distributed.fsdp.api`` is where upstream defines FSDP1's configuration types; its
``__all__`` names exactly the fourteen of ``API_ALL`` (R11), so ``from <ns>.api import *`` gives
them, and each is the class the namespace exports under the same name.
"""

from __future__ import annotations

import importlib

from conformance.adapters import base
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
