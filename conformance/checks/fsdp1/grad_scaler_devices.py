"""Area "fsdp1_runtime": on which device FSDP1's ``ShardedGradScaler`` reduces its record of
non-finite gradients across the ranks (R112).

[Note: the record goes to the scaler's device]
``unscale_`` keeps one "found inf" record per device its gradients live on. A record on the CPU is
all-reduced on the scaler's own device when that is not the CPU (moved there for the collective,
then copied back): with CPU-offloaded gradients and a CUDA scaler the group may be NCCL-only,
which cannot reduce a CPU tensor. On a CPU run the routing shows with ``device="meta"``: the
collective receives a meta tensor, and copying its result back fails, since a meta tensor holds no
data. The oracle is the rule: a dispatch-mode spy records the device of every all-reduce's tensor.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.registry import Skip, check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_GRAD_SCALER, base.TRAINING}


class _AllReduceDevices(TorchDispatchMode):
    """The device types of the tensors of every all-reduce op dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.devices: list[list[str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name)
        if "allreduce" in name.replace("_", ""):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.devices.append([t.device.type for t in tensors if isinstance(t, torch.Tensor)])
        return result


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def grad_scaler_record_on_scaler_device(ctx):
    """R112: ``ShardedGradScaler(device="meta", init_scale=4.0)`` over CPU gradients (one unit
    over ``Linear(4, 4)``, ``scale(loss).backward()``): ``unscale_`` all-reduces the record of
    non-finite gradients as a meta tensor (the scaler's device, not the gradients' CPU), and then
    raises NotImplementedError "Cannot copy out of meta tensor" copying it back."""
    if ctx.device.type != "cpu":
        raise Skip(f"needs CPU gradients: on {ctx.device.type} they live on the compute device")
    ns = ctx.impl.ns
    scaler_mod = importlib.import_module(f"{ns.__name__}.sharded_grad_scaler")
    ctx.seed(0)
    model = ns.FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_mod.ShardedGradScaler(device="meta", init_scale=4.0)
    g = torch.Generator().manual_seed(112)
    scaler.scale(model(torch.randn(2, 4, generator=g)).square().mean()).backward()
    spy = _AllReduceDevices()
    with spy:
        expect_error(
            ctx,
            'unscale_ of a ShardedGradScaler(device="meta") over CPU gradients',
            NotImplementedError,
            r"Cannot copy out of meta tensor",
            lambda: scaler.unscale_(opt),
        )
    assert spy.devices and all(d == ["meta"] for d in spy.devices), (
        f"{ctx.where()} unscale_ all-reduced tensors on {spy.devices}, expected the record on "
        "the scaler's device: [['meta']]"
    )
