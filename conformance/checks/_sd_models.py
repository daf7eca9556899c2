"""Models, wrap plans and helpers for the state-dict area (``state_dict.py``, ``state_dict_reshard.py``).

Every model is built from deterministic values (no seed needed, equal on every rank); ``salt``
changes every value, so a "fresh model with different values" is the same class with another salt.
Values are small (|v| < 1) so that a few SGD steps stay well conditioned.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base


def small_values(shape, salt: int, index: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Pairwise-distinct, non-zero values of magnitude < 1 with alternating signs; different for
    every (salt, index)."""
    n = math.prod(shape)
    k = torch.arange(n, dtype=torch.float64)
    sign = 1.0 - 2.0 * (k % 2)
    mag = (k + 1) / (n + 1) * 0.5 + 0.01 * salt + 0.001 * (index + 1)
    return (sign * mag).to(dtype).reshape(tuple(shape))


def fill_(module: nn.Module, salt: int) -> nn.Module:
    """Overwrite every parameter and floating buffer of ``module`` with ``small_values``."""
    with torch.no_grad():
        for i, (_, p) in enumerate(module.named_parameters()):
            p.copy_(small_values(p.shape, salt, i))
        for i, (_, b) in enumerate(module.named_buffers()):
            if b.is_floating_point():  # exact in fp16 too (buffer mixed precision round trips)
                steps = torch.arange(b.numel(), dtype=torch.float32).reshape(b.shape)
                b.copy_(2.0 * (i + 1) + 0.25 * steps + 0.5 * salt)
    return module


class Scale(nn.Module):
    """A module with one (1,)-parameter: as its own unit it leaves ranks >= 1 without data."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


class Net(nn.Module):
    """inner Linear(4,4) (own unit) -> outer Linear(4,5) -> head Linear(5,1) -> scale (own unit).

    Buffers: persistent ``buf`` (3,) on the root and ``inner_buf`` (2,) on ``inner`` (each with
    its own value), non-persistent ``scratch`` (2,) which a state dict must never contain.
    Shapes chosen for sharding: head.weight (1,5) and scale.weight (1,) have dim 0 < ws.
    """

    def __init__(self, salt: int = 0):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)
        self.head = nn.Linear(5, 1)
        self.scale = Scale()
        self.register_buffer("buf", torch.zeros(3))
        self.inner.register_buffer("inner_buf", torch.zeros(2))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        fill_(self, salt)

    def forward(self, x):
        h = torch.relu(self.inner(x))
        return self.scale(self.head(self.outer(h)))


NET_PLAN = [("inner", {}), ("scale", {}), ("", {})]  # children first, root last


class CheckpointedNet(nn.Module):
    """``Net``-like model whose ``inner`` is wrapped with ``checkpoint_wrapper`` (activation
    checkpointing) when ``wrap_ac``; its clean keys equal ``PlainNet``'s."""

    def __init__(self, salt: int = 0, wrap_ac: bool = True):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        inner = nn.Linear(4, 4)
        self.inner = checkpoint_wrapper(inner) if wrap_ac else inner
        self.outer = nn.Linear(4, 5)
        fill_(self, salt)

    def forward(self, x):
        return self.outer(torch.relu(self.inner(x)))


AC_PLAN = [("inner", {}), ("", {})]


class TiedNet(nn.Module):
    """Shared module (``net3 is net2``) and shared parameter (``shared_parameter is
    random_parameter``), as upstream's TestDummyModel."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.net1 = nn.Linear(4, 4)
        self.net2 = nn.Sequential(nn.Linear(4, 4))
        self.net3 = self.net2
        self.random_parameter = nn.Parameter(torch.zeros(4))
        self.shared_parameter = self.random_parameter
        fill_(self, salt)

    def forward(self, x):
        return self.net3(self.net2(self.net1(x))) + self.shared_parameter


# ------------------------------------------------------------------------------------- helpers
def inputs(rank: int, batch: int = 2, step: int = 0, features: int = 4) -> torch.Tensor:
    """The batch ``rank`` uses at ``step`` (distinct per rank and step)."""
    return small_values((batch, features), salt=17 * step + 3 * rank + 5) * 2.0


def train(model: nn.Module, ctx, steps: int = 2, lr: float = 0.1, local: bool = False) -> None:
    """A few SGD steps. Sharded (``local=False``): each rank uses its own batch and the
    implementation averages gradients. ``local=True``: an unwrapped copy trained on the global
    batch (every rank's batch, concatenated) with the mean loss, which is what the sharded model
    must compute."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        if local:
            x = torch.cat([inputs(r, step=step) for r in range(ctx.world_size)])
        else:
            x = inputs(ctx.rank, step=step)
        loss = model(x.to(ctx.device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def expected_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, detached and cloned on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def full_params(ctx, module: nn.Module, impl=None) -> dict[str, torch.Tensor]:
    """Every original parameter (clean FQN), reassembled on every rank from the layout view
    (``impl.local_shards``) and an all-gather: independent of the state-dict code under test."""
    impl = impl or ctx.impl
    flat = base.FLAT_PARAM in impl.capabilities
    mine = {base.clean_fqn(fqn): (v.global_shape, v.local.detach().cpu().clone(), v.offset)
            for fqn, v in impl.local_shards(module).items()}
    gathered = [None] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    out = {}
    for fqn, (shape, local, _) in mine.items():
        numel = math.prod(shape)
        full = torch.zeros(numel, dtype=local.dtype)
        for piece in gathered:
            _, part, offset = piece[fqn]
            if part.numel() == 0:
                continue
            row = 1 if flat else math.prod(shape[1:])
            start = offset * row
            full[start: start + part.numel()] = part.reshape(-1)
        out[fqn] = full.reshape(shape)
    return out


def first_error_everywhere(ctx, fn):
    """Run ``fn()`` on every rank; if it raised on any rank, raise on every rank (so no rank waits
    in a later collective for a rank that already failed). Returns ``fn()``'s value."""
    error = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below
        error, value = exc, None
    if ctx.world_size > 1:
        flag = torch.tensor([1.0 if error is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            raise AssertionError(f"{ctx.where()} the same call raised on another rank")
    if error is not None:
        raise error
    return value


def broadcast_from_rank0(ctx, obj):
    """Rank 0's object on every rank (``broadcast_object_list``)."""
    if ctx.world_size == 1:
        return obj
    box = [obj if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
