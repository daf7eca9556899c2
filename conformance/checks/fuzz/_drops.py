"""The fuzz area's steering data: features left out of a check's examples, for which deviation
sets, and why (see [Note: per-implementation drops] in :mod:`conformance.fuzz`). A drop names the
deviation set it belongs to (``impls="torch-fsdp2"``): it applies to that built-in and to every
adapter that ``inherits`` it, never to an implementation by its name alone. ``raises`` / ``match``
pin how the dropped feature fails there, so a fork that does not inherit the set and fails that way
is told which deviation it met and how to inherit it.
"""

from __future__ import annotations

from conformance.fuzz import Drop
from conformance.fuzz import strategies as fs

# Features left out of train_parity's examples, for which deviation sets, and why (see the Note in conformance.fuzz)
TRAIN_PARITY_DROPS = [
    Drop(
        fs.DIVIDE_FACTOR,
        "torch 2.13's FSDP2 reduce-scatters a custom divide factor other than the shard size with "
        "ReduceOp.PREMUL_SUM, which gloo rejects ('Cannot use ReduceOp.PREMUL_SUM with Gloo'), and "
        "at ws 1 divides an fp16 gradient by the factor twice; pinned by "
        "training::gradient_divide_factor and its expectations/torch-fsdp2{,.cpu}.txt entries "
        "(examples do not depend on the backend, so NCCL runs lose the feature too)",
        impls="torch-fsdp2",
        raises="RuntimeError|AssertionError",
        match="PREMUL_SUM with Gloo|mixed-precision steps the parameters are",
    ),
]


# Features left out of state_dict_round_trip's examples, for which deviation sets, and why (see the Note in
# conformance.fuzz); measured with 30 random examples per case at ws 1-3 plus examples that use the
# feature: ties in FULL dicts and zero-numel parameters in the references' SHARDED dicts pass on
# every implementation but the deviation set named below
SD_ROUND_TRIP_DROPS = [
    Drop(
        fs.RANK0_ONLY,
        "rank0_only configures FULL state dicts only (a SHARDED or LOCAL dict has none)",
        cases={"sharded", "local"},
    ),
    Drop(
        fs.ASSIGN,
        "load_state_dict(assign=True) loads the module's own DTensor dict (the sharded case); "
        "FULL and LOCAL dicts load through their own APIs",
        cases={"full", "local"},
    ),
    Drop(
        fs.ORIG_PARAMS,
        "LOCAL_STATE_DICT with use_orig_params=True is undefined upstream (S17: torch 2.13 returns a "
        "mixed dict of original and flat keys; the reference refuses it with a RuntimeError)",
        cases="local",
    ),
    Drop(
        fs.ZERO_SIZE,
        "torch 2.13's FSDP1 SHARDED load raises ZeroDivisionError for a unit holding a "
        "zero-numel parameter at ws >= 2 (found by this fuzzer; pinned by "
        "state_dict::zero_numel_param_round_trip and its expectations/torch-fsdp1.txt entries)",
        impls="torch-fsdp1",
        cases="sharded",
        raises="ZeroDivisionError",
    ),
]
