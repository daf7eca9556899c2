"""Area "fsdp1_runtime": ``sync_module_states`` at FSDP1 construction (R61), also of a
tensor-subclass buffer (R68).

[Note: what the ranks start from]
Each rank builds the module from the same seed and then adds its rank to every parameter and
buffer, so rank r starts from ``base + r`` and rank 0 from ``base``. With
``sync_module_states=True`` a unit replaces every rank's values of the parameters it manages and
of the module's buffers by rank 0's before it flattens them: after construction every rank holds
``base`` (parameters read back from the flat shards and an all-gather, buffers from the unit's
``named_buffers()``), and a forward equals the unwrapped module's built from ``base``. Without it
(the default, ``False``) nothing is broadcast: rank r keeps ``base + r``.

Upstream torch broadcasts only states that live on an accelerator: where any parameter or buffer
of the module is on the CPU it refuses at construction with ValueError naming
``sync_module_states=True``. That refusal is accepted in place of the broadcast, but only when some
state is on the CPU, and it must come for every kind of state: a module whose only states are
buffers is refused (or broadcast) as one whose only states are parameters is. What may never
happen is a construction that succeeds and leaves a rank with its own values.

``sync_module_states=True`` treats a tensor-subclass buffer (``TwoTensor``) as its inner
tensors: refused for CPU states as R61 says, or broadcast, never left per rank (R68).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


class _Both(nn.Module):
    """Linear(4, 3) plus a persistent buffer ``shift`` (3,) added to its output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x):
        return self.lin(x) + self.shift


class _BuffersOnly(nn.Module):
    """No parameter: a buffer ``shift`` (4,) added to the input and a buffer ``gain`` (4,)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(4))
        self.register_buffer("gain", torch.rand(4) + 0.5)

    def forward(self, x):
        return (x + self.shift) * self.gain


MODELS = {"both": _Both, "buffers_only": _BuffersOnly, "params_only": lambda: nn.Linear(4, 3)}


def _per_rank(ctx, model_name):
    """(the module of this rank: base + rank everywhere, the oracle: base = rank 0's)."""
    ctx.seed(0)
    oracle = MODELS[model_name]().to(ctx.device)
    mine = copy.deepcopy(oracle)
    with torch.no_grad():
        for t in [*mine.parameters(), *mine.buffers()]:
            t.add_(float(ctx.rank))
    return mine, oracle


def _assert_values(ctx, unit, want, what):
    """Every parameter and buffer of ``unit`` (clean names) equals ``want``'s."""
    got = full_params(ctx, unit) if list(want.parameters()) else {}
    for name, ref in want.named_parameters():
        assert name in got, f"{ctx.where()} {what}: parameter {name} not managed by the unit"
        assert_close(ctx, f"{what}: parameter {name}", got[name], ref, FP32["param"])
    bufs = {ctx.impl.clean_fqn(n): b for n, b in unit.named_buffers()}
    for name, ref in want.named_buffers():
        assert name in bufs, f"{ctx.where()} {what}: buffer {name} missing ({sorted(bufs)})"
        assert_close(ctx, f"{what}: buffer {name}", bufs[name], ref, FP32["param"])


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={name: {"model_name": name} for name in MODELS},
    world_sizes=(2,),
)
def sync_module_states_broadcast(ctx, model_name):
    """R61: ``FullyShardedDataParallel(m, sync_module_states=True)`` over ranks initialised
    differently (rank r adds r to every state) leaves every rank with rank 0's parameters and
    buffers and a forward equal to rank 0's module; or, where some state of ``m`` is on the CPU,
    refuses at construction with ValueError naming ``sync_module_states=True``, also for a module
    whose only states are buffers or only parameters; never a unit that kept a rank's own values."""
    ns = ctx.impl.ns
    mine, oracle = _per_rank(ctx, model_name)
    on_cpu = any(t.device.type == "cpu" for t in [*mine.parameters(), *mine.buffers()])
    try:
        unit = ns.FullyShardedDataParallel(mine, sync_module_states=True, **_kwargs(ctx))
    except ValueError as exc:
        assert on_cpu, (
            f"{ctx.where()} sync_module_states=True refused a module with no state on the CPU: "
            f"{exc}"
        )
        assert "sync_module_states=True" in str(exc), (
            f"{ctx.where()} the refusal of CPU states {str(exc)[:300]!r} does not name "
            "sync_module_states=True"
        )
        return
    _assert_values(ctx, unit, oracle, "after construction with sync_module_states=True")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(11)).to(ctx.device)
    with torch.no_grad():
        assert_close(ctx, "forward after the broadcast", unit(x), oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R68
class _SubclassBuffer(nn.Module):
    """No parameter; a buffer ``pair``, a ``TwoTensor`` (a tensor subclass holding two (3,)
    tensors ``a`` and ``b``), added to the input."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        self.register_buffer("pair", TwoTensor(torch.randn(3), torch.randn(3)))

    def forward(self, x):
        return x + self.pair


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(2,))
def sync_module_states_subclass_buffer(ctx):
    """R68: ``sync_module_states=True`` on a module whose only state is a tensor-subclass buffer
    (``TwoTensor``), rank r adding r to both inner tensors: either every rank holds rank 0's
    inner tensors after construction, or (some state on the CPU) construction is refused with
    ValueError naming ``sync_module_states=True`` (R61); never a unit that kept a rank's own
    values."""
    ctx.seed(0)
    mine = _SubclassBuffer().to(ctx.device)
    want = {k: getattr(mine.pair, k).clone() for k in ("a", "b")}  # rank 0's: same seed
    with torch.no_grad():
        for k in ("a", "b"):
            getattr(mine.pair, k).add_(float(ctx.rank))
    try:
        unit = ctx.impl.ns.FullyShardedDataParallel(mine, sync_module_states=True, **_kwargs(ctx))
    except ValueError as exc:
        assert mine.pair.device.type == "cpu", (
            f"{ctx.where()} sync_module_states=True refused a module on {mine.pair.device}: {exc}"
        )
        assert "sync_module_states=True" in str(exc), (
            f"{ctx.where()} the refusal {str(exc)[:300]!r} does not name sync_module_states=True"
        )
        return
    (pair,) = [b for n, b in unit.named_buffers() if n.endswith("pair")]
    for k, ref in want.items():
        assert_close(
            ctx, f"buffer pair.{k} after the broadcast", getattr(pair, k), ref, FP32["param"]
        )
