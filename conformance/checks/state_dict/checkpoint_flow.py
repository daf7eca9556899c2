"""Area "state_dict": train, save, load into a fresh sharded model, train on (S20).

[Note: the flow and its oracle]
Every rank builds ``Net`` (``_shared/sd_models.py``) with the same values and wraps it with
``NET_PLAN`` (``inner`` and ``scale`` as their own units, so ranks past the last chunk of
``scale.weight`` (1,) and ``head.weight`` (1, 5) hold nothing at ws >= 2). The wrapped model takes
3 SGD steps (lr 0.1, no momentum, so the optimizer carries no state a model checkpoint would lose),
rank r on its own batch; the *oracle*, an unwrapped copy on every rank, takes the same 3 steps on
the global batch (``sd_models.train``). The wrapped model's dict of the given kind is then loaded
into a freshly built wrapped model whose every value differs (salt 1), and on every rank:
* the loaded model's full parameters (reassembled from the layout view, never through the state-dict
  code) equal the oracle's, and its persistent buffers the saved ones (exactly);
* one more SGD step (fresh optimizers on both sides, ``train``'s first batch) has the oracle's loss
  on this rank's samples, and leaves the oracle's parameters.
``-to_cpu``: every tensor of the dict, a ShardedTensor's local shards included, is moved to the CPU
before loading (on a CPU compute device that changes nothing, so those cases skip).
Tolerances are ``oracle.FP32`` (the oracle sums in another order).
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import (
    AREA,
    Net,
    build,
    expected_state_dict,
    first_error_everywhere,
    full_params,
    inputs,
    require_kind,
    train,
)
from conformance.registry import Skip, check

STEPS = 3
CPU_KINDS = (
    "full",
    "sharded",
    "local",
    "dcp-full",
)  # kinds whose values are plain or ShardedTensor
CASES = {
    k: {"kind": k, "to_cpu": False}
    for k in ("full", "sharded", "local", "dtensor", "dcp-full", "dcp-sharded")
}
CASES |= {f"{k}-to_cpu": {"kind": k, "to_cpu": True} for k in CPU_KINDS}


def dict_to_cpu(sd: dict) -> dict:
    """``sd`` with every plain tensor moved to the CPU and every ShardedTensor's local shards too
    (in place, as a user moving a checkpoint off the accelerator would)."""
    out = {}
    for key, value in sd.items():
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                shard.tensor = shard.tensor.cpu()
        elif isinstance(value, torch.Tensor):
            value = value.cpu()
        out[key] = value
    return out


def assert_oracle_params(ctx, model, oracle, what: str) -> None:
    """``model``'s full parameters (from the layout view) equal the oracle's, on this rank."""
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert name in got, (
            f"{ctx.where()} {what}: parameter {name} missing from the layout ({sorted(got)})"
        )
        assert_close(
            ctx, f"{what}: {name} (vs the single-process oracle's)", got[name], ref, FP32["param"]
        )


@check(area=AREA, requires={base.TRAINING}, cases=CASES)
def checkpoint_flow(ctx, kind, to_cpu):
    """A dict saved after 3 SGD steps and loaded into a fresh sharded model with other values gives
    the single-process oracle's parameters on every rank, and one more step its loss (S20)."""
    require_kind(ctx, kind)
    if to_cpu and ctx.device.type == "cpu":
        raise Skip("needs an accelerator: on a CPU compute device the dict is already on the CPU")
    oracle = Net(0).to(ctx.device)
    train(oracle, ctx, steps=STEPS, local=True)
    model = build(ctx, salt=0)
    train(model, ctx, steps=STEPS)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    if to_cpu:
        sd = dict_to_cpu(sd)
    loaded = build(ctx, salt=1)
    first_error_everywhere(ctx, lambda: ctx.impl.load_state_dict(loaded, sd, kind))
    what = f"after loading the {kind} dict saved after {STEPS} steps"
    assert_oracle_params(ctx, loaded, oracle, what)
    saved = expected_state_dict(oracle)
    for name, buf in loaded.named_buffers():
        name = ctx.impl.clean_fqn(name)
        if name in saved:
            assert torch.equal(buf.detach().cpu(), saved[name]), (
                f"{ctx.where()} {what}: buffer {name} is {buf.tolist()}, expected the saved "
                f"{saved[name].tolist()}"
            )
    # The next step's loss on this rank's batch: the oracle's on the same samples (computed first,
    # under no_grad; never a no_grad forward of the sharded model before its optimizer is built,
    # as FSDP2 leaves the root's parameters unsharded after a forward without backward).
    with torch.no_grad():
        expected_loss = oracle(inputs(ctx.rank).to(ctx.device)).pow(2).mean()
    (loss,) = train(loaded, ctx, steps=1)
    train(oracle, ctx, steps=1, local=True)
    assert_close(
        ctx,
        f"{what}: loss of the next step on this rank's batch (vs the oracle's)",
        loss,
        expected_loss,
        FP32["loss"],
    )
    assert_oracle_params(ctx, loaded, oracle, f"one SGD step {what}")
