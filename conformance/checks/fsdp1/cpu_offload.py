"""Area "fsdp1_runtime": FSDP1 parameter offload at construction (R57).

[Note: what CPUOffload(offload_params=True) does before the first forward]
With ``cpu_offload=CPUOffload(offload_params=True)`` every unit keeps its sharded flat parameter
on the CPU: construction flattens and shards as without offload and then leaves (or moves) the
shard on the CPU, whatever the compute device. So right after construction each unit reports the
``CPUOffload`` it was given, its flat parameter is a CPU tensor, and it holds this rank's piece of
the flattened original parameters (FSDP1's layout, capability ``flat-param``). Training with
offload needs an accelerator (torch 2.13 pins the CPU copies and, on a CPU-only build, fails in
forward with "Cannot access accelerator device"; SPEC S23), so on the CPU only construction is
checked. The oracle is the unwrapped model's parameters.
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.sd_models import InnerHeadNet
from conformance.registry import check


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_CPU_OFFLOAD},
    world_sizes=(2,),
)
def cpu_offload_params_init(ctx):
    """R57: ``InnerHeadNet`` wrapped with ``inner`` its own unit and
    ``cpu_offload=CPUOffload(offload_params=True)`` on every unit: construction succeeds, each
    unit reports ``cpu_offload.offload_params`` True, both flat parameters are CPU tensors, and
    every original parameter's piece of them equals this rank's part of the unwrapped model's
    flattened values."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    offload = ns.CPUOffload(offload_params=True)
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {"cpu_offload": offload})]
    )
    units = [m for m in model.modules() if isinstance(m, ns.FullyShardedDataParallel)]
    assert len(units) == 2, f"{ctx.where()} {len(units)} FSDP units, expected 2 (inner, root)"
    for unit in units:
        assert unit.cpu_offload.offload_params is True, (
            f"{ctx.where()} a unit reports cpu_offload={unit.cpu_offload!r}, expected "
            "offload_params=True"
        )
    flats = ctx.impl.flat_shards(model)
    assert len(flats) == 2, f"{ctx.where()} {len(flats)} flat parameters, expected 2"
    for fqns, flat in flats:
        assert flat.device.type == "cpu", (
            f"{ctx.where()} the flat parameter of {fqns} is on {flat.device}, expected the CPU"
        )
    views = ctx.impl.local_shards(model)
    assert sorted(views) == sorted(n for n, _ in oracle.named_parameters()), (
        f"{ctx.where()} flattened {sorted(views)}"
    )
    for name, view in views.items():
        full = oracle.get_parameter(name).detach().cpu().reshape(-1)
        want = full[view.offset : view.offset + view.local.numel()]
        assert torch.equal(view.local.cpu(), want), (
            f"{ctx.where()} {name}: this rank's piece {view.local.reshape(-1)[:4].tolist()} at "
            f"offset {view.offset}, expected {want[:4].tolist()}"
        )


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_CPU_OFFLOAD, base.TRAINING},
    world_sizes=(2,),
)
def cpu_offload_params_training(ctx):
    """S23: the same two units with ``cpu_offload=CPUOffload(offload_params=True)`` train as the
    unwrapped model: two SGD steps on the global batch (rank r feeding its own samples) give each
    rank's loss, and the parameters reassembled after them, equal to the unwrapped model's; the
    flat parameters stay on the CPU. (On a CPU-only build torch 2.13 fails in the first forward
    with "Cannot access accelerator device": pinned in torch-fsdp1.cpu.txt.)"""
    from conformance.checks._shared.oracle import FP32, assert_close
    from conformance.checks._shared.sd_models import full_params

    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    offload = ns.CPUOffload(offload_params=True)
    model = ctx.impl.shard(
        copy.deepcopy(oracle),
        ctx,
        plan=[("inner", {"cpu_offload": offload}), ("", {"cpu_offload": offload})],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    ws, rank, b = ctx.world_size, ctx.rank, 2
    for step in range(2):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(ws * b, 4, generator=g).to(ctx.device)
        loss = model(x[rank * b : (rank + 1) * b]).square().mean()
        loss.backward()
        oracle(x).square().mean().backward()
        with torch.no_grad():
            want = oracle(x[rank * b : (rank + 1) * b]).square().mean()
        assert_close(ctx, f"step {step} loss", loss.detach(), want, FP32["loss"])
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
    for fqns, flat in ctx.impl.flat_shards(model):
        assert flat.device.type == "cpu", (
            f"{ctx.where()} after training the flat parameter of {fqns} is on {flat.device}"
        )
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after two steps", got[name], ref.detach().cpu(), FP32["param"])
