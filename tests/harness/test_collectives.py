"""The shared collective spy (``conformance/checks/_shared/collectives.py``) sees a reduce-scatter on
every path a correct FSDP may take, exactly once each, with its input and output dtypes; it sees
nothing where no reduce-scatter runs (an all-reduce, a local op)."""

from __future__ import annotations

from tests._spawn import run_on_ranks


def _paths(rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from conformance.checks._shared.collectives import observe_reduce_scatter

    mesh = init_device_mesh("cpu", (world_size,))
    group = dist.group.WORLD
    x = torch.arange(4 * world_size, dtype=torch.bfloat16)

    def out():
        return torch.empty(4, dtype=torch.bfloat16)

    def coalesced_manager():
        with dist._coalescing_manager(async_ops=False):
            dist.reduce_scatter_tensor(out(), x)

    paths = {
        "dist.reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out(), x),
        "dist._reduce_scatter_base": lambda: dist._reduce_scatter_base(out(), x),
        "dist.reduce_scatter": lambda: dist.reduce_scatter(out(), list(x.chunk(world_size))),
        "dist coalescing manager": coalesced_manager,
        "funcol.reduce_scatter_tensor": lambda: funcol.reduce_scatter_tensor(
            x, "sum", 0, group
        ).wait(),
        "funcol.reduce_scatter_tensor_autograd": lambda: funcol.reduce_scatter_tensor_autograd(
            x, "sum", 0, group
        ).wait(),
        "funcol.reduce_scatter_tensor_coalesced": lambda: [
            t.wait() for t in funcol.reduce_scatter_tensor_coalesced([x], "sum", [0], group)
        ],
        "DTensor Partial->Shard": lambda: (
            DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
        ),
        "none: all_reduce": lambda: dist.all_reduce(x.clone()),
        "none: local": lambda: x * 2,
    }
    seen = {}
    for name, fn in paths.items():
        with observe_reduce_scatter() as calls:
            fn()
        seen[name] = [c.dtypes for c in calls]
    return seen


def test_the_spy_sees_every_reduce_scatter_path_once():
    import torch

    seen = run_on_ranks(_paths, 2)[0]
    bf16 = (torch.bfloat16, torch.bfloat16)
    for name, calls in seen.items():
        expected = [] if name.startswith("none") else [bf16]
        assert calls == expected, f"{name}: the spy saw {calls}, expected {expected}"
