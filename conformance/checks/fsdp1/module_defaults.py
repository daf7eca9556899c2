"""Area "fsdp1_runtime": the module that defines ``FullyShardedDataParallel`` and a unit's
defaults (R16).

[Note: the class's module and defaults]
``FullyShardedDataParallel.__module__`` (upstream ``torch.distributed.fsdp.fully_sharded_data_parallel``)
names the class in its ``__all__``, so ``from <that module> import *`` gives the very class the
namespace exports (upstream lists ``OptimStateKeyType`` too; only the class is required here).
A unit built without ``cpu_offload`` reports ``unit.cpu_offload == CPUOffload()``
(``offload_params=False``), never ``None``; one built with ``CPUOffload(offload_params=False)``
reports an equal value.
"""

from __future__ import annotations

import importlib

from torch import nn

from conformance.adapters import base
from conformance.registry import check


@check(area="fsdp1_runtime", requires={base.FSDP1_API}, world_sizes=(1,))
def fsdp_module_exports(ctx):
    """R16: the module defining ``FullyShardedDataParallel`` lists it in ``__all__`` and
    ``from <module> import *`` gives the namespace's class."""
    cls = ctx.impl.ns.FullyShardedDataParallel
    module = importlib.import_module(cls.__module__)
    names = list(getattr(module, "__all__", ()))
    assert "FullyShardedDataParallel" in names, (
        f"{ctx.where()} {module.__name__}.__all__ is {names}; it must name FullyShardedDataParallel"
    )
    star: dict = {}
    exec(f"from {module.__name__} import *", star)  # noqa: S102 - the import users write
    assert star.get("FullyShardedDataParallel") is cls, (
        f"{ctx.where()} 'from {module.__name__} import *' does not give "
        f"{ctx.impl.ns.__name__}.FullyShardedDataParallel"
    )


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_RUNTIME})
def cpu_offload_default(ctx):
    """R16: a unit built without ``cpu_offload`` has ``cpu_offload == CPUOffload()`` (a
    ``CPUOffload`` with ``offload_params=False``); with ``CPUOffload(offload_params=False)``
    passed, an equal value."""
    ns = ctx.impl.ns
    ctx.seed(0)
    unit = ctx.impl.shard(nn.Linear(5, 7).to(ctx.device), ctx, plan=[("", {})])
    got = getattr(unit, "cpu_offload", "<missing>")
    assert isinstance(got, ns.CPUOffload) and got.offload_params is False, (
        f"{ctx.where()} unit.cpu_offload without cpu_offload= is {got!r}; expected "
        "CPUOffload(offload_params=False)"
    )
    given = ns.CPUOffload(offload_params=False)
    unit = ctx.impl.shard(nn.Linear(5, 7).to(ctx.device), ctx, plan=[("", {"cpu_offload": given})])
    assert unit.cpu_offload == given, (
        f"{ctx.where()} unit.cpu_offload is {unit.cpu_offload!r} after cpu_offload={given!r}"
    )
