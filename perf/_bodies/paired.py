"""Paired with upstream: an FSDP2-style implementation and upstream ``torch.distributed.fsdp`` in
ONE task, their steps interleaved round by round (see ``timing``), so that the load of a busy
machine hits both alike and their ratio is meaningful where separate tasks' medians are not.

Steps (each implementation on its own copy of the same parameters, one ``fully_shard`` group):
* ``unshard`` / ``unshard_upstream``: ``module.unshard(); module.reshard()`` — at world size 1 the
  unshard that skips the collective and copies the all-gather inputs;
* ``full_sd`` / ``full_sd_upstream``: ``get_model_state_dict(full_state_dict=True)``.
The case reports ``unshard`` with ``unshard_upstream`` as its floor, so ``×floor`` is the
implementation's time over upstream's in the same rounds. Each path is measured on its own (two
alternating steps, each run right after the other's): interleaving a heavy path with a light one
would hand whichever step follows the heavy one a cold cache. The two steps swap places every other
round (``measure(alternate=True)``), so neither always runs first.

Rounds: the report judges each case by its per-round ratios (implementation / upstream in the same
round) with a confidence interval for their median (``perf/report.py``), which needs rounds: at
least ``MIN_ROUNDS`` (a distribution-free 95% interval needs 6 at the very least, and is only
narrower than [min, max] from about 9; 16 leaves room for the report's joint intervals), and cheap
cases may take up to ``MAX_ROUNDS`` within ``--budget`` (more rounds, tighter intervals, no more
time than the budget). Only the slow cases (a second or so per round at world size 4) cost more
than ``--budget``: ``MIN_ROUNDS`` rounds of them.
"""

from __future__ import annotations

import torch

from perf._bodies.allgather import originals
from perf._bodies.shapes import Bag
from perf._bodies.state_dict import check_state_dict
from perf._bodies.timing import Step, measure

MIN_ROUNDS, MAX_ROUNDS = 16, 200  # see the module Note ("Rounds")


def fsdp2(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """Both implementations' unshard+reshard and FULL state dict, interleaved (module Note)."""
    ctx.require("fsdp2-api")
    import torch.distributed.fsdp as upstream
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    shape_list, origs = originals(ctx, shape_set, size_mb)
    full = StateDictOptions(full_state_dict=True)
    models = {"": ctx.impl.ns.fully_shard, "_upstream": upstream.fully_shard}
    for suffix, fully_shard in models.items():
        model = models[suffix] = fully_shard(Bag(shape_list, ctx.device), mesh=ctx.mesh)
        model.unshard()  # correctness once (and lazy init): the unsharded values are the originals
        for i, t in enumerate(origs):
            assert torch.equal(getattr(model, f"p{i}").detach(), t), (
                f"{ctx.where()} unsharded p{i}{suffix} != original"
            )
        model.reshard()
        check_state_dict(
            ctx, get_model_state_dict(model, options=full), origs, f"FULL state dict{suffix}"
        )
    runs = {
        "unshard": lambda m: (m.unshard(), m.reshard()),
        "full_sd": lambda m: get_model_state_dict(m, options=full),
    }
    if timing:  # not quick: enough rounds for the report's intervals (module Note)
        timing["min_rounds"] = max(timing.get("min_rounds", 0), MIN_ROUNDS)
        timing["max_rounds"] = max(timing.get("max_rounds", 0), MAX_ROUNDS)
    times = {}
    for path, run in runs.items():  # one path at a time: each step always follows the other's
        steps = {path + s: Step(lambda _, m=m, run=run: run(m)) for s, m in models.items()}
        times.update(measure(ctx, steps, quick=quick, alternate=True, **timing))
    return {"times": times, "info": {}}
