"""Area "training": ``fully_shard`` units called inside ``torch.func`` transforms (P118, P119).

[Note: functorch transforms]
``torch.func.jvp``, ``vmap`` and ``grad`` (and their compositions) run the function they transform
with their own wrapped tensors. A ``fully_shard`` unit inside such a function must still behave as
the unsharded module to the transform: it all-gathers its parameters before its forward and
reshards them after (the bookkeeping on its own buffers is not part of what is transformed, so it
must not trip over the wrapped tensors), and the transform's results (primal and tangent outputs,
batched outputs, input gradients) equal those of the same transform on the unsharded module. After
the transforms the units are sharded as before and a plain training step still equals the
unsharded model's. Model: ``Sequential(Linear(4, 6), Tanh(), Linear(6, 3))`` with both Linears
and the root units; every rank transforms the same inputs (so no reduction is involved), and
the training step feeds rank r its own ``B`` samples against the oracle on the global batch.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close, assert_sharded_grad
from conformance.checks.fully_shard.per_param_mesh import _is_sharded
from conformance.registry import check

REQUIRES = {base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING}


def _models(ctx, raf):
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model[0], model[2]):
        ctx.impl.ns.fully_shard(unit, mesh=ctx.mesh, reshard_after_forward=raf)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    return oracle, model


def _inputs(ctx):
    g = torch.Generator().manual_seed(118)
    x, t = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    return x.to(ctx.device), t.to(ctx.device)


TRANSFORMS = {
    # name: fn(module, x, t) -> a tuple of tensors, run on the sharded and the unsharded module
    "jvp": lambda m, x, t: torch.func.jvp(m, (x,), (t,)),
    "vmap": lambda m, x, t: (torch.func.vmap(m)(x.unsqueeze(1)),),
    "grad": lambda m, x, t: (torch.func.grad(lambda i: torch.tanh(m(i)).sum())(x),),
    "jvp-of-grad": lambda m, x, t: torch.func.jvp(
        torch.func.grad(lambda i: torch.tanh(m(i)).sum()), (x,), (t,)
    ),
    "vmap-of-jvp": lambda m, x, t: torch.func.vmap(lambda xi, ti: torch.func.jvp(m, (xi,), (ti,)))(
        x.unsqueeze(1), t.unsqueeze(1)
    ),
}


def _compare_transform(ctx, name, model, oracle):
    x, t = _inputs(ctx)
    got = TRANSFORMS[name](model, x, t)
    expected = TRANSFORMS[name](oracle, x, t)
    assert len(got) == len(expected), f"{ctx.where()} {name}: {len(got)} results"
    for i, (a, b) in enumerate(zip(got, expected)):
        assert type(a) is torch.Tensor, (
            f"{ctx.where()} {name}: result {i} is a {type(a).__name__}, expected a plain tensor"
        )
        assert_close(ctx, f"{name} result {i}", a, b, FP32["grad"])


def _train_step(ctx, model, oracle):
    """One plain step after the transforms: the children are sharded, and the output and sharded
    gradients equal the unsharded model's."""
    for i in (0, 2):
        for pname, param in model[i].named_parameters():
            assert _is_sharded(param), (
                f"{ctx.where()} after the transforms: {i}.{pname} is not sharded (not resharded)"
            )
    g = torch.Generator().manual_seed(119)
    gx = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    out = model(gx[mine])
    oout = oracle(gx)
    assert_close(ctx, "output after the transforms", out, oout[mine], FP32["loss"])
    out.pow(2).sum().backward()
    (oout.pow(2).sum() / ctx.world_size).backward()
    for fqn, param in model.named_parameters():
        fqn = ctx.impl.clean_fqn(fqn)
        assert_sharded_grad(
            ctx, f"{fqn} gradient after the transforms", param, oracle.get_parameter(fqn).grad
        )


# world sizes 1 and 2: every rank transforms the same inputs, so what a larger group adds (uneven
# rows, more peers) is the sharding the training checks already cover; ws 2 has the all-gathers
# and the reshards the transforms must not see. ws 3 and 4 cost the matrix about 3 s.
@check(
    area="training",
    requires=REQUIRES,
    cases={k: {"name": k} for k in TRANSFORMS},
    world_sizes=(1, 2),
)
def functorch_transforms(ctx, name):
    """P118: with ``Linear`` units (``reshard_after_forward=True``) under a root unit, a
    ``torch.func`` transform of the model (``jvp`` of the forward; ``vmap`` over an extra batch
    dim; ``grad`` of ``tanh(out).sum()`` w.r.t. the input; ``jvp`` of that ``grad``; ``vmap`` of
    ``jvp``) returns plain tensors equal to the same transform of the unsharded model, twice in a
    row; afterwards the Linears' parameters are sharded and a plain forward/backward (rank r on its
    samples) gives the unsharded model's output and the chunks of its global-batch gradients."""
    oracle, model = _models(ctx, True)
    for _ in range(2):
        _compare_transform(ctx, name, model, oracle)
    _train_step(ctx, model, oracle)


@check(
    area="training",
    requires=REQUIRES | {base.RESHARD_AFTER_FORWARD},
    cases={"jvp": {"name": "jvp"}, "grad": {"name": "grad"}},
    world_sizes=(4,),
)
def functorch_transforms_post_forward_mesh(ctx, name):
    """P119: as P118 with ``reshard_after_forward=2`` on a mesh of 4 (the Linears reshard after
    forward to a post-forward shard of 2 ranks): ``jvp`` / ``grad`` of the model equal the unsharded
    model's, and a plain training step afterwards still matches it."""
    oracle, model = _models(ctx, 2)
    for _ in range(2):
        _compare_transform(ctx, name, model, oracle)
    _train_step(ctx, model, oracle)
