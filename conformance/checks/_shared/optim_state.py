"""The optimizer state every optimizer-state-dict check compares with (S24, S26, P29): an
unsharded model's own Adam after the same steps, keyed by parameter FQN."""

from __future__ import annotations

import torch

from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.rows import chunk_of

# Adam's moments after two steps on the global batch: exp_avg as a gradient, exp_avg_sq (squared
# gradients, values near 1e-6) with an absolute floor below its smallest entries.
STATE_TOL = {"exp_avg": FP32["grad"], "exp_avg_sq": dict(rtol=1e-4, atol=1e-10)}


def assert_state(ctx, osd, oracle, oopt, full, what, local_piece):
    """``osd`` holds ``oopt``'s state under ``oracle``'s FQNs: the FQNs are the state's keys and
    the param groups' ``params``, ``step`` equals the oracle's, and each moment is a plain tensor
    equal to the oracle's (``full``) or holds this rank's ``torch.chunk(state, ws, 0)[rank]``.
    ``local_piece(name, key, value, full_value)`` asserts the sharded form's type and returns this
    rank's local tensor, or None when the form leaves this rank no rows."""
    names = [n for n, _ in oracle.named_parameters()]
    assert sorted(osd.get("state", {})) == sorted(names), (
        f"{ctx.where()} {what}: state keys {sorted(osd.get('state', {}))}, expected the FQNs "
        f"{sorted(names)}"
    )
    listed = [p for g in osd["param_groups"] for p in g["params"]]
    assert sorted(listed) == sorted(names), (
        f"{ctx.where()} {what}: param_groups list {listed}, expected the FQNs {names}"
    )
    for name, param in oracle.named_parameters():
        mine, want = osd["state"][name], oopt.state[param]
        assert float(mine["step"]) == float(want["step"]), (
            f"{ctx.where()} {what} {name}: step {mine['step']}, expected {want['step']}"
        )
        for key, tol in STATE_TOL.items():
            value = mine[key]
            if full:
                assert type(value) is torch.Tensor, (
                    f"{ctx.where()} {what} {name}.{key}: {type(value).__name__}, expected a "
                    "plain full tensor"
                )
                assert_close(ctx, f"{what} {name}.{key}", value, want[key], tol)
                continue
            expected = chunk_of(want[key], 0, ctx.world_size, ctx.rank)
            local = local_piece(name, key, value, want[key])
            if local is None:
                assert expected.numel() == 0, (
                    f"{ctx.where()} {what} {name}.{key}: no local shard, expected rows of "
                    f"{tuple(expected.shape)}"
                )
                continue
            assert_close(ctx, f"{what} {name}.{key} (this rank's chunk)", local, expected, tol)
