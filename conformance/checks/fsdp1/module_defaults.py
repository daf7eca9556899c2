"""Area "fsdp1_runtime": the module that defines ``FullyShardedDataParallel`` and a unit's
defaults (R16).

[Note: the class's module and defaults]
``FullyShardedDataParallel.__module__`` (upstream ``torch.distributed.fsdp.fully_sharded_data_parallel``)
names the class in its ``__all__``, so ``from <that module> import *`` gives the very class the
namespace exports (upstream lists ``OptimStateKeyType`` too; only the class is required here).
A unit built without ``cpu_offload`` reports ``unit.cpu_offload == CPUOffload()``
(``offload_params=False``), never ``None``; one built with ``CPUOffload(offload_params=False)``
reports an equal value. Without ``device_id`` a unit computes on the device of the module's first
parameter (the CPU for a module without parameters or buffers, on a CPU-only build), or refuses at
construction with a RuntimeError naming the device, as upstream does on a CPU-only build.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.registry import Skip, check


@check(area="fsdp1_runtime", requires={base.FSDP1_API, base.FLAT_PARAM}, world_sizes=(1,))
def fsdp_module_exports(ctx):
    """R16: the module defining ``FullyShardedDataParallel`` lists it in ``__all__`` and
    ``from <module> import *`` gives the namespace's class: the class of a unit it builds."""
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
    unit = ctx.impl.shard(nn.Linear(2, 3).to(ctx.device), ctx, plan=[("", {})])
    assert isinstance(unit, star["FullyShardedDataParallel"]), (
        f"{ctx.where()} a unit is a {type(unit).__name__}, not the class "
        f"'from {module.__name__} import *' gives"
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


class Scale(nn.Module):
    """No parameter and no buffer: multiplies by 2."""

    def forward(self, x):
        return 2 * x


DEVICE_CASES = {"params": {"empty": False}, "no-params": {"empty": True}}


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_RUNTIME}, cases=DEVICE_CASES)
def compute_device_without_device_id(ctx, empty):
    """R16: a unit built without ``device_id`` either refuses at once with a RuntimeError that
    names the device (upstream on a CPU-only build needs an accelerator) or computes on the
    device of the module's first parameter (a module without parameters or buffers: the CPU on
    a CPU-only build), and its forward gives the unwrapped module's output."""
    if empty and ctx.device.type != "cpu":
        raise Skip("a parameterless module's compute device is pinned on a CPU-only build only")
    ctx.seed(0)
    module = Scale() if empty else nn.Linear(5, 7).to(ctx.device)
    oracle = copy.deepcopy(module)
    try:
        unit = ctx.impl.ns.FullyShardedDataParallel(module)
    except RuntimeError as exc:
        assert "device" in str(exc).lower(), (
            f"{ctx.where()} FullyShardedDataParallel(module) without device_id raised "
            f"RuntimeError {exc}; a refusal must name the device"
        )
        return
    want = ctx.device if not empty else torch.device("cpu")
    got = getattr(unit, "compute_device", None)
    assert isinstance(got, torch.device) and got.type == want.type, (
        f"{ctx.where()} compute_device without device_id is {got!r}, expected {want} (the "
        "device of the module's first parameter)"
    )
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    assert_close(ctx, "forward without device_id", unit(x), oracle(x), FP32["loss"])


class RankValued(nn.Module):
    """Linear(3, 4) and a buffer ``scale`` (4,), each rank's values its own (seeded by rank)."""

    def __init__(self, rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(40 + rank)
        self.lin = nn.Linear(3, 4)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.register_buffer("scale", torch.randn(4, generator=g))

    def forward(self, x):
        return self.lin(x) * self.scale


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_RUNTIME}, world_sizes=(2,))
def sync_module_states_default(ctx):
    """R16: without ``sync_module_states`` (default False) a unit broadcasts nothing at
    construction: with a module whose values differ per rank (NO_SHARD, so each rank holds all
    of them), every rank's full parameters in ``summon_full_params`` and its buffer are that
    rank's own."""
    ns = ctx.impl.ns
    module = RankValued(ctx.rank).to(ctx.device)
    own = {n: t.detach().clone() for n, t in module.state_dict().items()}
    plan = [("", {"sharding_strategy": ns.ShardingStrategy.NO_SHARD})]
    unit = ctx.impl.shard(module, ctx, plan=plan)
    with ns.FullyShardedDataParallel.summon_full_params(unit, writeback=False):
        got = {ctx.impl.clean_fqn(n): p.detach().clone() for n, p in unit.named_parameters()}
    got["scale"] = unit.module.scale
    for name, want in own.items():
        assert name in got, f"{ctx.where()} {name} not found on the unit (names {sorted(got)})"
        assert torch.equal(got[name].to(want.device), want), (
            f"{ctx.where()} {name} is not this rank's own value after wrapping without "
            "sync_module_states (default False: nothing is broadcast)"
        )
