"""Barrier-aligned, interleaved timing rounds inside the ranks.

[Note: how a figure is measured]
A benchmark is a set of named *steps* (the path under test and its floors). One *round* runs every
step once, in order; before each step all ranks meet at a barrier, the device is synchronised, the
clock starts, the step runs, the device is synchronised and the clock stops. Each rank returns its
own per-round durations; the driver keeps, per round, the slowest rank (a collective is as slow as
its slowest participant). Interleaving the steps round by round means background load hits the
path and its floor alike, so their *ratio* stays meaningful on a busy machine even when the
absolute times do not.

Warm-up rounds run first and are discarded; their slowest-rank duration also sizes the number of
measured rounds (``budget_s / warm-up round``, clamped to ``[min_rounds, max_rounds]``), agreed on
by all ranks through an all-reduce(MAX) so every rank runs the same number of collectives.
In quick mode there is no warm-up and one round: a correctness run, not a measurement.

With ``alternate=True`` every other round runs the steps in reverse order, so that no step is
always first (or always last) in its round: a pair of steps compared round by round (the paired
area's per-round ratios) then carries no fixed position effect, and each step follows the other
and itself equally often (the rounds count is then made even).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Step:
    """``run(prepare())`` is timed; ``prepare`` (untimed) builds fresh inputs; ``after(value)``
    (untimed) undoes what ``run`` did (e.g. reshard after an unshard)."""

    run: Callable[[Any], Any]
    prepare: Callable[[], Any] | None = None
    after: Callable[[Any], None] | None = None


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def _one(step: Step, device: torch.device) -> float:
    arg = step.prepare() if step.prepare else None
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    value = step.run(arg)
    sync(device)
    elapsed = time.perf_counter() - start
    if step.after is not None:
        step.after(value)
    return elapsed


def measure(
    ctx,
    steps: dict[str, Step],
    *,
    quick: bool = False,
    warmup: int = 2,
    min_rounds: int = 5,
    max_rounds: int = 40,
    budget_s: float = 1.5,
    alternate: bool = False,
) -> dict[str, list[float]]:
    """This rank's per-round seconds for every step (see the module note)."""
    if quick:
        return {name: [_one(step, ctx.device)] for name, step in steps.items()}
    per_round = 0.0
    for _ in range(warmup):
        per_round = sum(_one(step, ctx.device) for step in steps.values())
    agreed = torch.tensor([per_round], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    rounds = min(max_rounds, max(min_rounds, math.ceil(budget_s / max(agreed.item(), 1e-9))))
    rounds += alternate and rounds % 2  # alternating: as many rounds in each order
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for i in range(rounds):
        for name, step in reversed(order) if alternate and i % 2 else order:
            times[name].append(_one(step, ctx.device))
    return times
