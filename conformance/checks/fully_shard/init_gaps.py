"""Areas "training" and "extensions": ``fully_shard`` set-up gaps (P80-P82).

* P80: per-parameter meshes follow the unit's ``reshard_after_forward``, the default included.
* P81: ``disable_fsdp_module_new_init()`` switches off the re-initialisation that an FSDP class's
  ``__new__`` gives a module constructed from it.
* P82: an explicit ``unshard()`` keeps the all-gather extension state of a sharded unit.

[Note: the FSDP class's constructor]
``fully_shard`` swaps a module's class for ``FSDP<Class>`` (``FSDPModule`` first in its MRO);
calling that class (as a container does when it indexes or slices itself: ``type(self)(...)``)
builds an instance of the *original* class and, as ``__new__`` returns an instance of another
class, Python would skip ``__init__``: so FSDP's ``__new__`` runs the original ``__init__`` itself.
Inside ``with disable_fsdp_module_new_init():`` (of ``<ns>._fully_shard._fully_shard``) it does not:
the object comes back bare (an empty ``__dict__``), as a loader that fills the attributes itself
wants. Leaving the block, by its end or by an exception, restores the previous setting (nested
blocks stay disabled until the outermost ends).

[Note: an allocating post-all-gather hook]
``Alloc1`` is ``_subclasses.Pair1`` whose ``fsdp_post_all_gather`` returns a *copy* of the gathered
values (its own storage) as the unsharded tensor and names that copy as the tensor to free. FSDP
frees its storage on reshard and must allocate it again before each later all-gather, which passes
``out=`` (the unsharded parameter, a view of that copy): the hook writes into ``out`` and first
asserts its storage holds the parameter (a freed one holds 0 bytes). An explicit ``unshard()``
runs the unit's lazy set-up again; that must not forget the tensors to re-allocate.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.internals import ns_module
from conformance.checks._shared.models import distinct_values
from conformance.checks._shared.oracle import B, make_optimizer, step_and_compare
from conformance.checks.fully_shard._subclasses import Pair1
from conformance.registry import check


class Duo(nn.Module):
    """``dense`` Linear(4, 6) -> tanh -> ``expert`` Linear(6, 4)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 6)
        self.expert = nn.Linear(6, 4)

    def forward(self, x):
        return torch.tanh(self.expert(torch.tanh(self.dense(x))))


class Top(nn.Module):
    """Two ``Duo`` units and a ``head`` Linear(4, 4) owned by the root itself."""

    def __init__(self):
        super().__init__()
        self.first = Duo()
        self.second = Duo()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def _is_sharded(param) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_PER_PARAM_MESH},
    world_sizes=(1,),
)
def per_param_mesh_reshard_default(ctx):
    """P80: with ``shard_placement_fn`` putting every ``expert`` parameter and the root's ``head``
    weight on a second mesh (``ShardPlacementResult(Shard(0), FSDPMeshInfo(mesh2,
    shard_mesh_dim=0))``, a group of its own), ``fully_shard(first)`` without
    ``reshard_after_forward``, ``fully_shard(second, reshard_after_forward=False)`` and the root
    without it all succeed; right after a training forward every parameter of ``first`` (both
    groups) is registered sharded (a DTensor), every one of ``second`` and of the root unsharded
    (a plain tensor); after the backward all are sharded again, and the SGD step equals the
    unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    ns = ctx.impl.ns
    common = ns_module(ctx, "_fully_shard._fsdp_common")
    ws, rank = ctx.world_size, ctx.rank
    mesh = ctx.make_mesh((ws,))
    mesh2 = DeviceMesh.from_group(dist.new_group(list(range(ws))), ctx.device.type)
    other = common.FSDPMeshInfo(mesh2, shard_mesh_dim=0)

    ctx.seed(0)
    oracle = Top().to(ctx.device)
    model = copy.deepcopy(oracle)
    moved = {id(p) for duo in (model.first, model.second) for p in duo.expert.parameters()}
    moved.add(id(model.head.weight))

    def placement_fn(param):
        if id(param) in moved:
            return common.ShardPlacementResult(placement=Shard(0), mesh_info=other)
        return None

    ns.fully_shard(model.first, mesh=mesh, shard_placement_fn=placement_fn)
    ns.fully_shard(
        model.second, mesh=mesh, shard_placement_fn=placement_fn, reshard_after_forward=False
    )
    ns.fully_shard(model, mesh=mesh, shard_placement_fn=placement_fn)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    g = torch.Generator().manual_seed(80)
    x = torch.randn(ws * B, 4, generator=g).to(ctx.device)
    loss = model(x[rank * B : (rank + 1) * B]).square().mean()
    for fqn, param in model.named_parameters():
        want = fqn.startswith("first.")  # non-root, default: resharded after forward
        assert _is_sharded(param) == want, (
            f"{ctx.where()} after forward {fqn} is registered "
            f"{'sharded' if _is_sharded(param) else 'unsharded'}, expected "
            f"{'sharded' if want else 'unsharded'} (first: default, second: False, root: default)"
        )
    loss.backward()
    oracle(x).square().mean().backward()
    for fqn, param in model.named_parameters():
        assert _is_sharded(param), f"{ctx.where()} after backward {fqn} is not sharded"
    step_and_compare(ctx, model, oracle, opts, 0)


@check(area="training", requires={base.FSDP2_API, base.FSDP2_NEW_INIT_SWITCH}, world_sizes=(1,))
def new_init_switch(ctx):
    """P81: for ``m = nn.Linear(4, 4)`` after ``fully_shard(m)``, ``type(m)(3, 5)`` is a plain
    ``nn.Linear`` with a weight of shape (5, 3); inside ``with disable_fsdp_module_new_init():`` (of
    ``<ns>._fully_shard._fully_shard``) it is an ``nn.Linear`` with an empty ``__dict__``, also in a
    nested block after the inner one ends; after the block, and after an exception raised inside a
    block, it is initialised again."""
    ns = ctx.impl.ns
    switch = ns_module(ctx, "_fully_shard._fully_shard").disable_fsdp_module_new_init
    model = nn.Linear(4, 4).to(ctx.device)
    ns.fully_shard(model, mesh=ctx.make_mesh((ctx.world_size,)))
    cls = type(model)
    assert cls is not nn.Linear, f"{ctx.where()} setup: fully_shard kept the class nn.Linear"

    def assert_initialised(when):
        made = cls(3, 5)
        assert type(made) is nn.Linear, f"{ctx.where()} {when}: {cls.__name__}(3, 5) is {made!r}"
        assert tuple(made.weight.shape) == (5, 3), (
            f"{ctx.where()} {when}: {cls.__name__}(3, 5).weight has shape "
            f"{tuple(made.weight.shape)}, expected (5, 3)"
        )

    def assert_bare(when):
        made = cls(3, 5)
        assert type(made) is nn.Linear and not vars(made), (
            f"{ctx.where()} {when}: {cls.__name__}(3, 5) is a {type(made).__name__} with "
            f"attributes {sorted(vars(made))}, expected an uninitialised nn.Linear"
        )

    assert_initialised("before the switch")
    with switch():
        assert_bare("inside disable_fsdp_module_new_init()")
        with switch():
            assert_bare("inside a nested block")
        assert_bare("after the nested block ended, inside the outer one")
    assert_initialised("after the block")
    try:
        with switch():
            raise KeyError("raised inside the block")
    except KeyError:
        pass
    assert_initialised("after a block left by an exception")


class Alloc1(Pair1):
    """``Pair1`` whose post hook allocates the unsharded tensor (module Note)."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        gathered_a = all_gather_outputs[0]
        if out is None:
            unsharded = gathered_a.clone()
            return unsharded, (unsharded,)
        need = out.numel() * out.element_size()
        have = out.untyped_storage().nbytes()
        assert have >= need, (
            f"post hook: out= has {have} bytes of storage, expected at least {need} "
            "(the tensor to free was not allocated again)"
        )
        with torch.no_grad():
            out.copy_(gathered_a)
        return None


class AllocLinear(nn.Module):
    """A bias-free Linear whose weight (rows, 3) is an ``Alloc1``."""

    def __init__(self, rows: int):
        super().__init__()
        values = distinct_values((rows, 3), 0) / 100.0
        self.weight = nn.Parameter(Alloc1(values.clone(), -values.clone()))

    def forward(self, x):
        return F.linear(x, self.weight)


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.DTENSOR_PARAMS},
    world_sizes=(1,),
)
def extension_explicit_unshard(ctx):
    """P82: a unit over an ``Alloc1`` weight (module Note: the post hook allocates the unsharded
    tensor and names it to free), ``reshard_after_forward=True``: after a forward (no grad),
    ``unshard()``, ``reshard()``, ``unshard()`` give the original values as the registered
    (unsharded) weight each time, the post hook finding ``out=``'s storage allocated; after
    ``reshard()`` the weight is sharded again and a second forward's output equals the unsharded
    model's."""
    rows = 2 * ctx.world_size
    original = distinct_values((rows, 3), 0) / 100.0
    module = AllocLinear(rows).to(ctx.device)
    ctx.impl.ns.fully_shard(
        module, mesh=ctx.make_mesh((ctx.world_size,)), reshard_after_forward=True
    )
    x = (distinct_values((2, 3), 4) / 100.0).to(ctx.device)
    expected = x.cpu() @ original.T

    def check_output(when):
        with torch.no_grad():
            out = module(x).cpu()
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-7), (
            f"{ctx.where()} {when}: forward output differs from the unsharded model's"
        )

    check_output("first forward")
    for i in range(2):
        module.unshard()
        weight = module.weight
        assert not _is_sharded(weight), (
            f"{ctx.where()} explicit unshard {i}: the registered weight is still sharded"
        )
        assert torch.equal(weight.detach().cpu(), original), (
            f"{ctx.where()} explicit unshard {i}: the unsharded weight differs from the original"
        )
        module.reshard()
        assert _is_sharded(module.weight), (
            f"{ctx.where()} reshard after explicit unshard {i}: the weight is not sharded"
        )
    check_output("forward after the explicit unshards")
