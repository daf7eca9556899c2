"""Area "training": ``fully_shard(..., ignored_params=...)`` on a module whose parameters are all
ignored but which holds buffers (P97).

[Note: ignored parameters and the buffers beside them]
``fully_shard(model, ignored_params=S)`` leaves the parameters in ``S`` alone: not sharded (plain
tensors, not DTensors), not moved to the mesh's device, their gradients not reduced. A module
whose own parameters are all in ``S`` (and whose children are all ignored too) is left out of
FSDP's management, unless it holds a buffer: such a module stays managed, so its buffers are moved
to the mesh's device like every other managed buffer (only the parameters are ignored). The model
is built on the CPU and sharded on ``ctx.device``; on a CPU-only run the two coincide and the
device half holds trivially. In training a ``BatchNorm1d`` whose parameters are ignored sees only
its rank's samples (its batch statistics, running statistics and gradients are those of the
unsharded model run on the rank's slice alone), while the sharded ``Linear`` before it gets the
gradient averaged over the ranks (the unsharded model run on each rank's slice in turn, the
per-slice losses averaged).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close, shard_dim
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check


class LinearNorm(nn.Module):
    """``Linear(4, 4)`` then ``BatchNorm1d(4)`` (running statistics as buffers)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))


@check(area="training", requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API})
def ignored_params_module_with_buffers(ctx):
    """P97: ``fully_shard(m, mesh, ignored_params=set(m.norm.parameters()))`` on
    ``LinearNorm`` built on the CPU (module Note): ``norm.weight``/``norm.bias`` stay plain tensors
    on the CPU with their values, ``lin``'s parameters are DTensors, and ``norm``'s buffers
    (``running_mean``, ``running_var``, ``num_batches_tracked``) are on the mesh's device, since
    ``norm`` holds buffers and so stays managed. After ``m.norm.to(device)`` a training forward
    gives the unsharded model's output on the rank's slice, ``lin``'s sharded gradient is the
    chunk of the gradient averaged over the ranks' slices, ``norm``'s gradients and running
    statistics are the rank's own (not reduced)."""
    ws, rank, device = ctx.world_size, ctx.rank, ctx.device
    ctx.seed(0)
    built = LinearNorm()
    model = copy.deepcopy(built)
    ignored = set(model.norm.parameters())
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, ignored_params=ignored)
    for name in ("weight", "bias"):
        param = getattr(model.norm, name)
        assert not isinstance(param, DTensor), f"{ctx.where()} ignored norm.{name} is a DTensor"
        assert param.device.type == "cpu", (
            f"{ctx.where()} ignored norm.{name} moved to {param.device}; ignored parameters stay"
        )
        assert torch.equal(param.detach(), getattr(built.norm, name).detach()), (
            f"{ctx.where()} ignored norm.{name} changed its values"
        )
    for name, param in model.lin.named_parameters():
        assert isinstance(param, DTensor), f"{ctx.where()} lin.{name} is not a DTensor"
    for name, buf in model.norm.named_buffers():
        assert buf.device.type == device.type, (
            f"{ctx.where()} norm.{name} is on {buf.device}, expected the mesh's device "
            f"{device.type}: a module holding buffers stays managed even with every parameter ignored"
        )
    model.norm.to(device)
    glob = copy.deepcopy(built).to(device)  # Linear's oracle: slices one by one, losses averaged
    own = copy.deepcopy(built).to(device)  # norm's oracle: this rank's slice alone
    g = torch.Generator().manual_seed(97)
    x = torch.randn(ws * 4, 4, generator=g).to(device)
    slices = [slice(r * 4, (r + 1) * 4) for r in range(ws)]
    out = model(x[slices[rank]])
    expected = own(x[slices[rank]])
    assert_close(ctx, "training forward output", out, expected, FP32["param"])
    out.square().mean().backward()
    expected.square().mean().backward()
    torch.stack([glob(x[s]).square().mean() for s in slices]).mean().backward()
    for name, param in model.lin.named_parameters():
        assert_close(
            ctx,
            f"lin.{name} sharded gradient (averaged over the ranks' slices)",
            param.grad.to_local(),
            chunk_of(glob.lin.get_parameter(name).grad, shard_dim(param), ws, rank),
            FP32["grad"],
        )
    for name, param in model.norm.named_parameters():
        assert param.grad is not None and not isinstance(param.grad, DTensor), (
            f"{ctx.where()} ignored norm.{name}: gradient {type(param.grad).__name__}, expected "
            "a plain tensor"
        )
        assert_close(
            ctx,
            f"ignored norm.{name} gradient (this rank's, not reduced)",
            param.grad,
            own.norm.get_parameter(name).grad,
            FP32["grad"],
        )
    for name, buf in model.norm.named_buffers():
        expected_buf = own.norm.get_buffer(name)
        if buf.is_floating_point():
            assert_close(ctx, f"norm.{name} after the forward", buf, expected_buf, FP32["param"])
        else:
            assert torch.equal(buf.cpu(), expected_buf.cpu()), f"{ctx.where()} norm.{name} differs"
