"""Area "states": ``register_fsdp_forward_method`` (P30), and its refusal of a name the unit lacks
(P92).

[Note: a method other than forward]
FSDP2 unshards a unit around ``forward`` only. ``register_fsdp_forward_method(module, name)`` wraps
``module.<name>`` the same way: calling it (on a unit that is not inside another unit's forward)
all-gathers the unit's parameters first, runs the method on the unsharded parameters and
then treats them as after a forward (P2: a non-root unit with ``reshard_after_forward=True``
reshards; the first unit called becomes the root and keeps them unsharded), and a backward through its output reduces
the gradients as a forward's would. So ``model.enc.encode(x)`` returns the unsharded model's
``enc.encode(x)``, the parameters are SHARDED DTensors again after it, and the sharded gradients
after a backward are the oracle's chunks (every rank feeds the same batch here).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close, shard_dim
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        return self.lin(x)

    def encode(self, x):
        """Not forward: uses the parameters directly."""
        return torch.tanh(nn.functional.linear(x, self.lin.weight, self.lin.bias)) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.enc(x))


@check(
    area="states",
    requires={base.DTENSOR_PARAMS, base.FSDP2_API, base.FSDP2_FORWARD_METHOD},
    world_sizes=(1, 2),
)
def registered_forward_method(ctx):
    """P30: after ``register_fsdp_forward_method(model.enc, "encode")`` and one ordinary step
    (so ``model`` is the root), a call of ``model.enc.encode(x)`` (not forward) returns the unsharded model's ``enc.encode(x)``, leaves
    ``enc``'s parameters registered as sharded DTensors, and a backward through it gives them the
    oracle's gradient chunks. The registered ``model.enc.encode`` keeps the method's ``__name__``
    and ``__doc__``."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    oracle = Net().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("enc", {}), ("", {})])
    ctx.impl.ns.register_fsdp_forward_method(model.enc, "encode")
    wrapped = model.enc.encode
    for attr in ("__name__", "__doc__"):
        assert getattr(wrapped, attr, None) == getattr(Encoder.encode, attr), (
            f"{ctx.where()} enc.encode.{attr} after registration is "
            f"{getattr(wrapped, attr, None)!r}, expected the method's own "
            f"{getattr(Encoder.encode, attr)!r}"
        )
    x = torch.randn(3, 4, device=ctx.device)
    model(x).sum().backward()  # lazy init from the root: enc is a non-root unit (P2: reshards)
    model.zero_grad(set_to_none=True)
    out = model.enc.encode(x)
    ref = oracle.enc.encode(x)
    assert_close(ctx, "enc.encode(x) (vs the unsharded model's)", out, ref, FP32["loss"])
    for name, param in model.enc.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} enc.{name}: {type(param).__name__} after encode(), expected the "
            "sharded DTensor registered again"
        )
    out.sum().backward()
    ref.sum().backward()
    for name, param in model.enc.named_parameters():
        assert param.grad is not None, f"{ctx.where()} enc.{name}: no gradient after backward"
        expected = chunk_of(
            oracle.enc.get_parameter(name).grad, shard_dim(param), ctx.world_size, ctx.rank
        )
        assert_close(
            ctx, f"enc.{name} sharded gradient", param.grad.to_local(), expected, FP32["grad"]
        )


def _pair(ctx):
    """``Sequential(Linear(4, 4), Tanh(), Linear(4, 2))`` and its sharded copy (both Linears and
    the root are units)."""
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(ctx.device)
    model = copy.deepcopy(oracle)
    for unit in (model[0], model[2], model):
        ctx.impl.ns.fully_shard(unit, mesh=ctx.mesh)
    return model, oracle


def _assert_forward_matches(ctx, model, oracle, what):
    g = torch.Generator().manual_seed(91)
    x = torch.randn(B, 4, generator=g).to(ctx.device)
    with torch.no_grad():
        assert_close(ctx, f"{what}: forward output", model(x), oracle(x), FP32["param"])


@check(area="states", requires={base.FSDP2_API, base.FSDP2_FORWARD_METHOD}, world_sizes=(1, 2))
def forward_method_missing_name(ctx):
    """P92: ``register_fsdp_forward_method(unit, name)`` for a name the unit lacks raises
    ValueError naming the unit's class and the name (``<class ...FSDPSequential'> does not have a
    method encode_all``) and registers nothing; on a module that is not an ``FSDPModule`` it is a
    no-op, even for a missing name. The model still computes the unsharded model's output."""
    ns = ctx.impl.ns
    model, oracle = _pair(ctx)
    expect_error(
        ctx,
        "register_fsdp_forward_method(model, 'encode_all')",
        ValueError,
        rf"{type(model).__name__}.*does not have a method encode_all",
        lambda: ns.register_fsdp_forward_method(model, "encode_all"),
    )
    assert not hasattr(model, "encode_all"), f"{ctx.where()} the refused name was registered"
    plain = nn.Linear(4, 4)
    try:
        ns.register_fsdp_forward_method(plain, "encode_all")
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} register_fsdp_forward_method on a plain nn.Linear raised "
            f"{type(exc).__name__}: {str(exc)[:300]}; it is a no-op for a non-FSDP module"
        ) from exc
    _assert_forward_matches(ctx, model, oracle, "after the refused registration")
