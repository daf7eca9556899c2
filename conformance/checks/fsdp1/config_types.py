"""Area "fsdp1_runtime": the fields and defaults of FSDP1's configuration dataclasses (R18).

[Note: configuration fields]
Each configuration type of ``<ns>.api`` is a dataclass with exactly the fields below, in this
order, with these defaults (upstream's documented constructors, so a user's keyword arguments
and ``dataclasses.replace`` / ``asdict`` work the same everywhere). The optimizer-state configs
default ``offload_to_cpu`` to True except ``LocalOptimStateDictConfig`` (False); the model
state-dict configs default it to False.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from conformance.adapters import base
from conformance.registry import check

# class -> (base class name or None, ((field, default), ...)) in declaration order
FIELDS = {
    "MixedPrecision": (
        None,
        (
            ("param_dtype", None),
            ("reduce_dtype", None),
            ("buffer_dtype", None),
            ("keep_low_precision_grads", False),
            ("cast_forward_inputs", False),
            ("cast_root_forward_inputs", True),
            ("_module_classes_to_ignore", (_BatchNorm,)),
        ),
    ),
    "CPUOffload": (None, (("offload_params", False),)),
    "StateDictConfig": (None, (("offload_to_cpu", False),)),
    "FullStateDictConfig": ("StateDictConfig", (("offload_to_cpu", False), ("rank0_only", False))),
    "LocalStateDictConfig": ("StateDictConfig", (("offload_to_cpu", False),)),
    "ShardedStateDictConfig": (
        "StateDictConfig",
        (("offload_to_cpu", False), ("_use_dtensor", False)),
    ),
    "OptimStateDictConfig": (None, (("offload_to_cpu", True),)),
    "FullOptimStateDictConfig": (
        "OptimStateDictConfig",
        (("offload_to_cpu", True), ("rank0_only", False)),
    ),
    "LocalOptimStateDictConfig": ("OptimStateDictConfig", (("offload_to_cpu", False),)),
    "ShardedOptimStateDictConfig": (
        "OptimStateDictConfig",
        (("offload_to_cpu", True), ("_use_dtensor", False)),
    ),
}


@check(area="fsdp1_runtime", requires={base.FSDP1_API}, world_sizes=(1,))
def config_fields(ctx):
    """R18: every FSDP1 configuration type of ``<ns>.api`` is a dataclass (itself, not only by
    inheritance) with exactly the listed fields, in order, and their defaults; keyword
    construction sets each field (``MixedPrecision(buffer_dtype=torch.bfloat16)``)."""
    ns = ctx.impl.ns
    try:
        api = importlib.import_module(f"{ns.__name__}.api")
    except ModuleNotFoundError as exc:
        raise base.NotSupported(f"no {ns.__name__}.api module ({exc})") from exc
    for name, (parent, fields) in FIELDS.items():
        cls = getattr(api, name)
        assert "__dataclass_fields__" in vars(cls), (
            f"{ctx.where()} {api.__name__}.{name} is not itself a dataclass"
        )
        if parent is not None:
            assert issubclass(cls, getattr(api, parent)), (
                f"{ctx.where()} {name} does not derive from {parent}"
            )
        got = tuple((f.name, f.default) for f in dataclasses.fields(cls))
        assert got == fields, (
            f"{ctx.where()} {name} fields (name, default) {got}, expected {fields}"
        )
        made = cls()
        for field, default in fields:
            assert getattr(made, field) == default, (
                f"{ctx.where()} {name}().{field} is {getattr(made, field)!r}, expected {default!r}"
            )
    mp = api.MixedPrecision(buffer_dtype=torch.bfloat16)
    assert mp.buffer_dtype == torch.bfloat16 and mp.param_dtype is None, (
        f"{ctx.where()} MixedPrecision(buffer_dtype=bf16) gives {mp!r}"
    )
    cfg = api.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert cfg.offload_to_cpu and cfg.rank0_only, (
        f"{ctx.where()} FullStateDictConfig(offload_to_cpu=True, rank0_only=True) gives {cfg!r}"
    )
