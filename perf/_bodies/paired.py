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

[Note: blocks — replicating over allocations]
Where a model's buffers land in memory is fixed for the model's lifetime, and it moves a byte-bound
step's time by a few per cent either way (cache-set and page placement: the same ``uneven`` 32 MiB
unshard measured 1.02×, 1.03× and 0.94× upstream in three fresh processes doing identical copies).
Rounds on one pair of models therefore all share one draw of that placement, and an interval over
rounds is too narrow: one allocation decides the verdict. So the rounds are split into ``BLOCKS``
blocks, and before each block both models are built afresh (fresh modules holding copies of the
originals, fresh ``fully_shard``; the previous block's models freed first), behind a spacer tensor
whose size differs per block and in an order that alternates per block, so that the allocator does
not hand back the same addresses. Each block is one draw of the placement; the report judges a case
by its block medians (the median per-round ratio within each block, see
``perf/report.py::median_ci``). ``BLOCKS`` is the fewest blocks for which a 95% distribution-free
interval exists jointly over the paired targets' largest case count (12: the FULL state dict at
world sizes 2 and 4 over six shape configurations), i.e. ``report.min_blocks(12)``. The first build
is checked in full; a rebuild compares one parameter after unshard (the construction path is the
same, the check only guards the wiring).

Rounds: each block takes at least ``MIN_BLOCK_ROUNDS`` rounds (one in each order) and, when cheap,
up to ``MAX_ROUNDS // BLOCKS`` within its share ``--budget / BLOCKS``, after its own warm-up round
(the first calls on fresh models are lazy init and cold caches). Only the slow cases (a second or
so per round at world size 4) cost more than ``--budget``: ``BLOCKS × (warm-up + 2)`` rounds.
"""

from __future__ import annotations

import gc

import torch

from perf._bodies.allgather import originals
from perf._bodies.shapes import Bag
from perf._bodies.state_dict import check_state_dict
from perf._bodies.timing import Step, measure

BLOCKS = 9  # see the module Note ("blocks"); tests check it against report.min_blocks
MIN_BLOCK_ROUNDS, MAX_ROUNDS = 2, 200
SPACER_STEP = 1_000_003  # bytes (odd: not a page or cache-line multiple) of spacer per block


def fsdp2(ctx, shape_set: str, size_mb: float, quick: bool = False, **timing) -> dict:
    """Both implementations' unshard+reshard and FULL state dict, interleaved, in blocks over
    fresh allocations (module Note)."""
    ctx.require("fsdp2-api")
    import torch.distributed.fsdp as upstream
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    shape_list, origs = originals(ctx, shape_set, size_mb)
    full = StateDictOptions(full_state_dict=True)
    builders = {"": ctx.impl.ns.fully_shard, "_upstream": upstream.fully_shard}
    last = len(origs) - 1

    def build(block: int) -> dict:
        order = list(builders.items())
        models = {}
        for suffix, fully_shard in order if block % 2 == 0 else order[::-1]:
            module = Bag(shape_list, ctx.device, values=origs)
            model = models[suffix] = fully_shard(module, mesh=ctx.mesh)
            model.unshard()  # correctness (and lazy init): the unsharded values are the originals
            checked = enumerate(origs) if block == 0 else [(last, origs[last])]
            for i, t in checked:
                assert torch.equal(getattr(model, f"p{i}").detach(), t), (
                    f"{ctx.where()} unsharded p{i}{suffix} != original (block {block})"
                )
            model.reshard()
            if block == 0:
                check_state_dict(
                    ctx,
                    get_model_state_dict(model, options=full),
                    origs,
                    f"FULL state dict{suffix}",
                )
        return models

    runs = {
        "unshard": lambda m: (m.unshard(), m.reshard()),
        "full_sd": lambda m: get_model_state_dict(m, options=full),
    }
    blocks = 1 if quick or not timing else BLOCKS
    if timing:  # not quick: enough rounds per block, the budget shared by the blocks
        timing["min_rounds"] = MIN_BLOCK_ROUNDS
        timing["max_rounds"] = max(MIN_BLOCK_ROUNDS, MAX_ROUNDS // blocks)
        timing["budget_s"] = timing.get("budget_s", 1.5) / blocks
    times: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {path: [] for path in runs}
    gc.collect()
    gc.freeze()  # what lives now outlives the blocks: the per-block collections skip it (~100 ms)
    try:
        for block in range(blocks):
            gc.collect()  # the previous block's models (their hooks hold cycles) are freed first
            spacer = torch.empty(SPACER_STEP * block, dtype=torch.uint8, device=ctx.device)
            models = build(block)
            for path, run in runs.items():  # one path at a time: each step follows the other's
                steps = {path + s: Step(lambda _, m=m, run=run: run(m)) for s, m in models.items()}
                got = measure(ctx, steps, quick=quick, alternate=True, **timing)
                for name, ts in got.items():
                    times.setdefault(name, []).extend(ts)
                sizes[path].append(len(got[path]))
            del models, spacer, steps  # the lambdas hold the models too
    finally:
        gc.unfreeze()
    return {"times": times, "info": {"round_blocks": sizes}}
