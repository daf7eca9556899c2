"""Area "extensions": parameters whose local shard defines ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` are all-gathered through those hooks (P14): with an explicit
``unshard()`` (P82), on an HSDP mesh (P16), under CPU offload (P96), and refused when the pre
hook does not pad an uneven shard (P105); resharding one to a smaller post-forward group is
refused in backward (P129).

[Note: the protocol]
* FSDP calls the pre hook on the rank's *local* shard: with one argument ``(mesh)`` (legacy) or five
  ``(mesh, outer_size, outer_stride, module, mp_policy)``; ``mesh`` is the 1-D shard mesh,
  ``outer_size``/``outer_stride`` the parameter's global size and stride, ``module`` the module
  that owns the parameter. It returns ``(all_gather_inputs, metadata)``; for an uneven dim 0 each
  input must already have the padded shard size (``ceil(d0/ws)`` rows); for an even one FSDP takes
  inputs of any size as they are (``pre5-even-flat-inputs``: the shard flattened to 1-D). The
  uneven error is raised only on the ranks with a short shard while rank 0 enters the all-gather,
  so no check provokes it (it would hang the others).
* FSDP all-gathers every input (each one is the ranks' inputs concatenated in rank order) and calls
  the post hook with ``(outputs, metadata, param_dtype)``: the first time with ``out=None`` (it
  returns ``(unsharded, tensors_to_free)``), every later time with ``out=`` the unsharded parameter
  built from that first result, whose storage the new all-gather refilled. ``param_dtype`` is the
  policy's ``param_dtype``, else the parameter's own dtype, on every call.
* The module computes with the unsharded tensor, so its forward equals the unsharded model's.
The subclass (``_subclasses.PairTensor``) carries two tensors ``a`` (values) and ``b == -a``, so the
check sees both gathered inputs; expected values are the original tensor and its negation.

[Note: an allocating post-all-gather hook]
``Alloc1`` is ``_subclasses.Pair1`` whose ``fsdp_post_all_gather`` returns a *copy* of the gathered
values (its own storage) as the unsharded tensor and names that copy as the tensor to free. FSDP
frees its storage on reshard and must allocate it again before each later all-gather, which passes
``out=`` (the unsharded parameter, a view of that copy): the hook writes into ``out`` and first
asserts its storage holds the parameter (a freed one holds 0 bytes). An explicit ``unshard()``
runs the unit's lazy set-up again; that must not forget the tensors to re-allocate (P82).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values, expect_error
from conformance.checks._shared.rows import chunk_of, chunk_range, chunk_size
from conformance.checks.fully_shard import _subclasses
from conformance.checks.fully_shard._subclasses import Flat5, Pair1, Pair5, Single5
from conformance.checks.fully_shard.per_param_mesh import _is_sharded
from conformance.registry import check


class PairLinear(nn.Module):
    """A bias-free Linear whose weight (rows, 3) is a Pair tensor; records the weight it computes
    with."""

    def __init__(self, rows: int, cls, salt: int = 0):
        super().__init__()
        values = distinct_values((rows, 3), salt) / 100.0
        self.weight = nn.Parameter(cls(values.clone(), -values.clone()))
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(self.weight)
        return F.linear(x, self.weight)


CASES = {
    "pre1-even": {"cls": Pair1, "uneven": False},
    "pre5-even": {"cls": Pair5, "uneven": False},
    "pre5-uneven": {"cls": Pair5, "uneven": True},
    "pre5-uneven-one-input": {"cls": Single5, "uneven": True},
    # inputs of another shape than the shard (1-D) are taken as they are for an even dim 0
    "pre5-even-flat-inputs": {"cls": Flat5, "uneven": False},
}


def _rows(ctx, uneven):
    return 2 * ctx.world_size + (1 if uneven else 0)


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API},
    cases={k: {"name": k} for k in CASES},
)
def all_gather_through_hooks(ctx, name):
    """Both gathered inputs equal the original (and its negation) in full, trimmed to the global size;
    the pre hook gets the shard mesh (and, with 5 arguments, the global size/stride and the owning
    module); a later all-gather passes ``out=`` the unsharded parameter of the first; every post
    hook call, the ``out=`` ones included, gets ``param_dtype`` float32 (no policy: the parameter's
    own dtype); forward uses the unsharded values."""
    spec = CASES[name]
    rows = _rows(ctx, spec["uneven"])
    module = PairLinear(rows, spec["cls"]).to(ctx.device)
    original = distinct_values((rows, 3), 0) / 100.0
    ctx.impl.ns.fully_shard(module, mesh=ctx.mesh, reshard_after_forward=True)
    x = (distinct_values((2, 3), 4) / 100.0).to(ctx.device)
    expected_out = x.cpu() @ original.T
    _subclasses.LOG.clear()
    outs = []
    try:
        for _ in range(2):
            with torch.no_grad():
                outs.append(module(x).cpu())
        log = list(_subclasses.LOG)
    finally:
        _subclasses.LOG.clear()
    pre = [e for e in log if e["hook"].startswith("pre")]
    post = [e for e in log if e["hook"] == "post"]
    assert len(pre) == 2 and len(post) == 2, (
        f"{ctx.where()} {name}: hooks called {[e['hook'] for e in log]} over two forwards "
        f"(reshard_after_forward=True), expected pre and post once per forward"
    )
    for entry in pre:
        mesh = entry["mesh"]
        assert mesh.ndim == 1 and mesh.size() == ctx.world_size, (
            f"{ctx.where()} {name}: pre hook got mesh {mesh}, expected the 1-D shard mesh of {ctx.world_size}"
        )
        start, end = chunk_range(rows, ctx.world_size, ctx.rank)
        assert entry["local_shape"] == (end - start, 3), (
            f"{ctx.where()} {name}: pre hook ran on a local shard of shape {entry['local_shape']}, "
            f"expected {(end - start, 3)}"
        )
        if entry["hook"] == "pre5":
            assert entry["outer_size"] == (rows, 3) and entry["outer_stride"] == (3, 1), (
                f"{ctx.where()} {name}: pre hook outer size/stride {entry['outer_size']}/"
                f"{entry['outer_stride']}, expected {(rows, 3)}/(3, 1)"
            )
            assert entry["module"] is module, (
                f"{ctx.where()} {name}: pre hook module is not the owner"
            )
    for i, entry in enumerate(post):
        assert torch.equal(entry["a"].cpu(), original), (
            f"{ctx.where()} {name}: all-gather {i}: gathered values differ from the original"
        )
        assert entry["b"] is None or torch.equal(entry["b"].cpu(), -original), (
            f"{ctx.where()} {name}: all-gather {i}: the second gathered input differs from -original"
        )
        assert entry["param_dtype"] == torch.float32, (
            f"{ctx.where()} {name}: post hook call {i} (out={'None' if i == 0 else 'given'}) got "
            f"param_dtype={entry['param_dtype']}, expected torch.float32 (no policy: the "
            f"parameter's own dtype)"
        )
    assert post[0]["out"] is None, (
        f"{ctx.where()} {name}: first post hook call got out={post[0]['out']!r}"
    )
    assert post[1]["out"] is not None, f"{ctx.where()} {name}: second post hook call got out=None"
    assert post[1]["out"] is module.seen[0], (
        f"{ctx.where()} {name}: second post hook call got out= something other than the unsharded "
        f"parameter of the first forward"
    )
    assert module.seen[1] is module.seen[0], (
        f"{ctx.where()} {name}: the second forward computed with a new unsharded parameter"
    )
    for i, out in enumerate(outs):
        assert torch.allclose(out, expected_out, rtol=1e-6, atol=1e-7), (
            f"{ctx.where()} {name}: forward {i} output differs from the unsharded model's"
        )


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.TRAINING},
    cases={
        "pre5-uneven-raf-true": {"cls": Pair5, "raf": True},
        "pre5-uneven-raf-false": {"cls": Pair5, "raf": False},
        "pre5-uneven-one-input": {"cls": Single5, "raf": True},
    },
)
def train_step_through_hooks(ctx, cls, raf):
    """Training through an all-gather-extension parameter matches the unsharded model: each step's
    loss, the sharded gradient (the oracle's mean-gradient chunk, a plain-tensor DTensor) and, after
    3 SGD steps, the values the pre hook hands to the all-gather (the shard's ``a``) (P14, P6)."""
    train_through_hooks(ctx, cls, raf)


def train_through_hooks(ctx, cls, raf, **shard_kwargs):
    """Three SGD steps of a ``PairLinear`` of ``cls`` (uneven dim 0) sharded with
    ``reshard_after_forward=raf`` and ``shard_kwargs``, compared with the unsharded weight."""
    ws, rank = ctx.world_size, ctx.rank
    rows = _rows(ctx, uneven=True)
    module = PairLinear(rows, cls).to(ctx.device)
    oracle = (distinct_values((rows, 3), 0) / 100.0).to(ctx.device).requires_grad_(True)
    ctx.impl.ns.fully_shard(module, mesh=ctx.mesh, reshard_after_forward=raf, **shard_kwargs)
    opt = torch.optim.SGD(module.parameters(), lr=0.5, foreach=False)
    oopt = torch.optim.SGD([oracle], lr=0.5)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(2 * ws, 3, generator=g).to(ctx.device)
        y = torch.randn(2 * ws, rows, generator=g).to(ctx.device)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = F.mse_loss(module(x[mine]), y[mine])
        oloss = ((x @ oracle.T - y) ** 2).mean(dim=1)
        assert torch.allclose(
            loss.detach().cpu(), oloss[mine].mean().detach().cpu(), rtol=1e-5, atol=1e-6
        ), (
            f"{ctx.where()} step {step}: loss {loss.item():.6g}, oracle {oloss[mine].mean().item():.6g}"
        )
        loss.backward()
        oloss.mean().backward()
        grad = module.weight.grad
        assert grad is not None, f"{ctx.where()} step {step}: no sharded gradient after backward"
        expected = chunk_of(oracle.grad, 0, ws, rank)
        local = grad.to_local()
        local = local.a if isinstance(local, _subclasses.PairTensor) else local
        assert local.shape == expected.shape and torch.allclose(
            local.detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=1e-6
        ), (
            f"{ctx.where()} step {step}: sharded gradient {tuple(local.shape)} differs from the "
            f"oracle's chunk {tuple(expected.shape)}"
        )
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    shard = module.weight.to_local()
    values = shard.a if isinstance(shard, _subclasses.PairTensor) else shard
    assert torch.allclose(
        values.detach().cpu(), chunk_of(oracle, 0, ws, rank).detach().cpu(), rtol=1e-4, atol=1e-5
    ), f"{ctx.where()} after 3 steps: the shard's values differ from the oracle's rows"


BROKEN = {  # class, error pattern (both AssertionError upstream)
    "pre-only": (_subclasses.PreOnly, r"Both fsdp_pre_all_gather and fsdp_post_all_gather"),
    "post-only": (_subclasses.PostOnly, r"Both fsdp_pre_all_gather and fsdp_post_all_gather"),
    "pre-2-args": (_subclasses.Pre2, r"Invalid fsdp_pre_all_gather"),
    "pre-4-args": (_subclasses.Pre4, r"Invalid fsdp_pre_all_gather"),
}


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API},
    cases={k: {"name": k} for k in BROKEN},
)
def extension_error_contracts(ctx, name):
    """A shard defining only one of ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` raises
    AssertionError 'Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined ...'; a pre
    hook taking neither 1 nor 5 arguments raises AssertionError 'Invalid fsdp_pre_all_gather ...';
    either at ``fully_shard`` or at the first forward, on every rank (P14)."""
    cls, pattern = BROKEN[name]
    module = PairLinear(2 * ctx.world_size, cls).to(ctx.device)
    x = (distinct_values((2, 3), 4) / 100.0).to(ctx.device)
    expect_error(
        ctx,
        name,
        AssertionError,
        pattern,
        lambda: ctx.impl.ns.fully_shard(module, mesh=ctx.mesh),
        lambda: module(x),
    )


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


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.HSDP},
    world_sizes=(2, 4),
)
def hsdp_extension_shard_mesh(ctx):
    """P16, P14: on an HSDP mesh ``("replicate", "shard")`` of shape (ws/2, 2), a parameter whose
    tensor subclass implements ``fsdp_pre_all_gather`` (``Pair5``) gets the shard sub-mesh in
    that hook: 1-D, named ``("shard",)``, of size 2 (a shard size of 1 takes upstream's
    no-all-gather path, which hands a two-input extension one output: left out); the forward computes with the original
    values."""
    shard = 2
    mesh = ctx.make_mesh((ctx.world_size // shard, shard), ("replicate", "shard"))
    rows = 2 * ctx.world_size
    module = PairLinear(rows, _subclasses.Pair5).to(ctx.device)
    original = distinct_values((rows, 3), 0) / 100.0
    ctx.impl.ns.fully_shard(module, mesh=mesh)
    x = (distinct_values((2, 3), 4) / 100.0).to(ctx.device)
    _subclasses.LOG.clear()
    try:
        with torch.no_grad():
            out = module(x).cpu()
        meshes = [e["mesh"] for e in _subclasses.LOG if e["hook"].startswith("pre")]
    finally:
        _subclasses.LOG.clear()
    assert len(meshes) == 1, f"{ctx.where()} pre hook ran {len(meshes)} time(s), expected once"
    got = (meshes[0].ndim, tuple(meshes[0].mesh_dim_names or ()), meshes[0].size())
    assert got == (1, ("shard",), shard), (
        f"{ctx.where()} pre hook got a mesh (ndim, names, size) {got}; expected the shard "
        f"sub-mesh (1, ('shard',), {shard})"
    )
    assert torch.equal(out, x.cpu() @ original.T), (
        f"{ctx.where()} forward output differs from the original weight's"
    )


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.TRAINING, base.CPU_OFFLOAD},
)
def train_step_through_hooks_offload(ctx):
    """P96: an all-gather-extension parameter (``Single5``, uneven dim 0) under
    ``offload_policy=CPUOffloadPolicy(pin_memory=False)`` trains as without offload:
    FSDP hands the pre hook the shard moved to the compute device, and each step's loss, the sharded
    gradient and the values after 3 SGD steps equal the unsharded model's."""
    train_through_hooks(
        ctx, Single5, True, offload_policy=ctx.impl.ns.CPUOffloadPolicy(pin_memory=False)
    )


class Unpadded5(Pair5):
    """``Pair5`` whose 5-argument pre hook hands FSDP its local shard as it is, never padded."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), {"rows": outer_size[0]}


@check(area="extensions", requires={base.EXTENSIONS, base.FSDP2_API}, world_sizes=(2,))
def unpadded_all_gather_inputs_refused(ctx):
    """P105: for a parameter unevenly sharded on dim 0 (``PairLinear`` of 2 * ws + 1 rows), an
    ``fsdp_pre_all_gather`` (5-argument form) returning all-gather inputs of the unpadded local
    size is refused on each rank whose shard is padded: ``unit.unshard()`` raises AssertionError
    "When a parameter is unevenly sharded by FSDP (orig size=..., FSDP world size=<ws>),
    fsdp_pre_all_gather must return all-gather inputs with the padded sharded size ...", before
    any communication (only those ranks call it; the others hold a full shard)."""
    ws = ctx.world_size
    rows = 2 * ws + 1
    module = PairLinear(rows, Unpadded5).to(ctx.device)
    ctx.impl.ns.fully_shard(module, mesh=ctx.mesh)
    if module.weight.to_local().shape[0] == chunk_size(rows, ws):
        return  # a full shard: nothing to pad, and no rank to all-gather with
    expect_error(
        ctx,
        "unshard() with unpadded all-gather inputs",
        AssertionError,
        rf"When a parameter is unevenly sharded by FSDP \(orig size=.*FSDP world size={ws}\), "
        r"fsdp_pre_all_gather must return all-gather inputs with the padded sharded size",
        module.unshard,
    )


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API, base.RESHARD_AFTER_FORWARD},
    world_sizes=(4,),
)
def extension_smaller_mesh_reshard_refused(ctx):
    """P129: a unit over an all-gather-extension weight with one all-gather input (``Single5``,
    dim 0 even: 8 rows) sharded with ``reshard_after_forward=2`` (a 2-rank post-forward group of
    4) computes its forward as the unsharded weight does (the output equals ``x @ w.T``), but
    gathering again from the smaller group for backward goes through no extension: the backward
    raises NotImplementedError (on every rank alike, so nothing hangs)."""
    ws, rank = ctx.world_size, ctx.rank
    rows = 2 * ws
    module = PairLinear(rows, Single5).to(ctx.device)
    full = (distinct_values((rows, 3), 0) / 100.0).to(ctx.device)
    ctx.impl.ns.fully_shard(module, mesh=ctx.mesh, reshard_after_forward=2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * ws, 3, generator=g).to(ctx.device)
    mine = slice(2 * rank, 2 * rank + 2)
    out = module(x[mine])
    assert torch.allclose(out.detach().cpu(), (x[mine] @ full.T).cpu(), rtol=1e-5, atol=1e-6), (
        f"{ctx.where()} forward with reshard_after_forward=2 differs from x @ w.T"
    )
    expect_error(
        ctx,
        "backward after a reshard to the 2-rank post-forward group",
        NotImplementedError,
        r"",
        lambda: out.square().sum().backward(),
    )
