"""Hypothesis strategies that draw fuzz examples (driver side; see :mod:`conformance.fuzz.model`).

What is drawn depends on the world size, the implementation's capabilities and the check's
*features* (a check that does not train draws no mixed precision, ...). An example never asks an
implementation for something it does not declare: the example is adjusted instead (the option is
left out, a wrap unit that the layout cannot take is dropped).

Zero-size parameters: where a check's examples may hold them, a drawn share (:data:`ZERO_SHARE`:
``sampled_from([False, True, True])``, False first so that shrinking removes the leaf unless the
failure needs it) of the examples gets a ``param`` leaf with a zero dim put at a drawn place of the
tree, on top of the zeros ``dims`` draws; measured over 100 derandomized examples at ws 2, 58-62%
of the references' examples hold one (2-8% from ``dims`` alone); torch-fsdp1's share is lower
because its mixed-precision examples draw no zero dims (below).

Options drawn for one kind of check only: ``assign`` (FSDP2's own DTensor dict loaded with
``assign=True``: state_dict_round_trip[sharded]); an HSDP ``mesh`` (``HSDP_MESHES``: (1, 2) or
(2, 1) at ws 2, (2, 2) at ws 4) and per-unit ``divide_factors`` from (1, ws, 3) (FSDP2 API:
train_parity, whose oracle scales each unit's gradient by ws / f); ``accumulate``: 0-2 FSDP1
micro-batches under ``no_sync()`` before each synced one (train_parity, whose oracle sums the
gradients of all of them). FSDP1's runtime knobs (``unit_knobs``, implementations declaring
``flat-param`` and ``fsdp1-api``): ``sharding_strategy`` per unit (:data:`STRATEGIES`; an example
with ``rank0_only`` has no NO_SHARD unit; for layout and train_parity, a third of the examples at
ws 2 and 4 put every unit on an ``fsdp1_mesh`` from ``HSDP_MESHES`` with HYBRID_SHARD or
_HYBRID_SHARD_ZERO2, capability ``fsdp1-hybrid-shard``), and for the training checks ``backward_prefetch`` /
``forward_prefetch`` per unit (capability ``fsdp1-prefetch``) and ``limit_all_gathers`` (one value
for every unit, as upstream requires); every unit of the plan gets them explicitly, since FSDP1
passes the root's kwargs on to the units it wraps. Per-check drops for a
deviation set (torch-fsdp2's divide factors, ...) are :class:`conformance.fuzz.Drop` s next to the
checks.

Known upstream limitations the examples steer around (each also covered, as an expected failure,
by a hand-written check) are :data:`STEERS`: each names the deviation set it belongs to
(``torch-fsdp2``, ``torch-fsdp1``) and applies to the implementations whose lineage holds it (the
upstream built-ins and the forks that declare ``inherits``; see [Note: per-implementation drops]
in :mod:`conformance.fuzz`), so the fuzz exercises them on the reference and on every other fork:
* ``torch-fsdp1``: torch 2.13's FSDP1 cannot wrap a unit whose parameters all have numel 0
  (``layout::flat_param_*[*-zero-`` in expectations/torch-fsdp1.txt): such implementations'
  flat-parameter units manage no parameters or some elements (reference-fsdp1 shards such units:
  measured with examples holding them, every fuzz check passes at ws 2-3);
* ``torch-fsdp2``: torch 2.13's FSDP2 cannot run backward through a unit that holds a parameter
  with numel 0, at any world size (``RuntimeError: _chunk_cat expects non-empty tensor`` in the
  reduce-scatter copy-in; found by this fuzzer; ``training::train_parity_zero_numel_param``):
  checks that train draw no zero dims for per-parameter layouts;
* ``torch-fsdp2``: torch 2.13's FSDP2 fails (``IndexError`` in ``foreach_all_gather_copy_out``)
  when an int ``reshard_after_forward`` meets a ``Shard(d != 0)`` placement (found by this fuzzer;
  ``training::train_parity_raf_int_shard_dim1``): an example with placements draws only bool
  ``reshard_after_forward`` values;
* ``torch-fsdp1``: FSDP1 wraps batch norms as their own units when mixed precision meets a wrap
  policy (W11), which can leave a unit with only empty parameters (the empty-unit limitation
  above): examples with mixed precision have no zero dims;
* ``torch-fsdp1``: torch 2.13's FSDP1 switches a hybrid unit whose shard group has one rank to
  NO_SHARD and never reduces its gradients across the replicate group
  (``fsdp1_runtime::hybrid_shard_default_groups``, torch-fsdp1.cpu expectations): training
  examples put FSDP1 hybrid units on no (replicate, 1) mesh.

Per-check steers are :class:`conformance.fuzz.Drop` s next to the checks
(``conformance/checks/fuzz/_drops.py``), e.g. torch-fsdp1's SHARDED_STATE_DICT load raises
``ZeroDivisionError`` for a module holding a zero-numel parameter (found by this fuzzer), so its
``sharded`` state-dict case draws no zero dims.

Rules every example follows, for every implementation:
* FSDP1 wraps batch norms as their own units when mixed precision meets a wrap policy (W11),
  which would split a tie: batch norms are never tied;
* ``load_state_dict(assign=True)`` gives every key its own new Parameter, the aliases of a tie
  too, so it unties them (nn.Module's rule, not FSDP's): an example with ties is never loaded with
  ``assign``;
* tied parameters split over two units are not a supported configuration of either API: a unit
  holds both ends of a tie or neither. (Torch DCP's full load rejects the alias keys of
  ``state_dict::shared_params``' model, a shared module plus a second attribute naming one
  parameter: ``[*-dcp-full`` expectations; the ties drawn here, one leaf's weight reused by another
  leaf, load on every built-in, so checks that load full DCP state dicts draw them too.)
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from conformance.adapters import base
from conformance.fuzz import deviation_sets
from conformance.fuzz import model as fm

# check features: what a check's examples may contain beyond a model and a wrap plan
MIXED_PRECISION = "mixed-precision"
TIES = "ties"
PLACEMENTS = "placements"
RESHARD = "reshard-after-forward"
ORIG_PARAMS = "use-orig-params"
TRAINING = "training"  # the check runs backward (see the zero-size limitation above)
ZERO_SIZE = "zero-size"  # parameters may have zero dims
CPU_OFFLOAD = "cpu-offload"
RANK0_ONLY = "rank0-only"  # FSDP1 FULL state dicts with FullStateDictConfig(rank0_only=True)
ASSIGN = "assign"  # FSDP2 module.load_state_dict(own DTensor dict, assign=True) (P9)
HSDP = "hsdp"  # a 2-D (replicate, shard) mesh at ws 2 and 4
DIVIDE_FACTOR = "divide-factor"  # FSDP2 set_gradient_divide_factor per unit
STRATEGY = "sharding-strategy"  # FSDP1 sharding_strategy per unit
# FSDP1 backward_prefetch / forward_prefetch per unit, limit_all_gathers per model
PREFETCH = "fsdp1-prefetch"
ACCUMULATE = "no-sync-accumulation"  # FSDP1 micro-batches under no_sync() before a synced one
FSDP1_HSDP = "fsdp1-hsdp"  # FSDP1 HYBRID_SHARD / _HYBRID_SHARD_ZERO2 units on a 2-D mesh
# (replicate, shard) mesh shapes per world size
HSDP_MESHES = {2: [[1, 2], [2, 1]], 4: [[2, 2]]}
ALL_FEATURES = frozenset(
    {
        MIXED_PRECISION,
        TIES,
        PLACEMENTS,
        RESHARD,
        ORIG_PARAMS,
        TRAINING,
        ZERO_SIZE,
        CPU_OFFLOAD,
        RANK0_ONLY,
        ASSIGN,
        HSDP,
        DIVIDE_FACTOR,
        STRATEGY,
        PREFETCH,
        ACCUMULATE,
        FSDP1_HSDP,
    }
)
# FSDP1 runtime knobs, per unit (a plan kwarg of every unit; limit_all_gathers has one value for
# the whole model), first values the defaults so that shrinking goes back to them
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
HYBRID_STRATEGIES = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]  # every unit, on one HSDP_MESHES mesh
BACKWARD_PREFETCHES = ["BACKWARD_PRE", None, "BACKWARD_POST"]
ACCUMULATIONS = [0, 1, 2]  # micro-batches under no_sync() before each synced one


@dataclass(frozen=True)
class Steer:
    """A known limitation of the deviation set ``impls`` that :func:`examples` steers around for
    every implementation whose lineage holds that set (see the module docstring). ``needs``: the
    check features without which it cannot show; ``raises`` / ``match``: how it fails (exception
    class names joined by ``|``, a regex searched in the message), so that a fork that does not
    inherit the set and fails that way is told which deviation it met."""

    name: str
    impls: str
    needs: frozenset
    reason: str
    raises: str = ""
    match: str = ""


# steer names (what examples() asks steers() for)
NO_ZERO_BACKWARD = "no-zero-numel-backward"
NO_INT_RAF_WITH_PLACEMENTS = "no-int-reshard-with-placements"
NO_EMPTY_FLAT_UNITS = "no-units-of-only-empty-parameters"
NO_ZERO_WITH_MP_FLAT = "no-zero-dims-with-flat-mixed-precision"
NO_ONE_RANK_HYBRID_GROUP = "no-hybrid-shard-group-of-one-rank"
_EMPTY_UNIT = "unsharded_start_idx: 0 unsharded_end_idx: -1"
STEERS = (
    Steer(
        NO_ZERO_BACKWARD,
        "torch-fsdp2",
        frozenset({ZERO_SIZE, TRAINING}),
        "torch 2.13's FSDP2 cannot run backward through a unit holding a numel-0 parameter "
        "('_chunk_cat expects non-empty tensor'); pinned by training::train_parity_zero_numel_param",
        raises="RuntimeError",
        match="_chunk_cat expects non-empty tensor",
    ),
    Steer(
        NO_INT_RAF_WITH_PLACEMENTS,
        "torch-fsdp2",
        frozenset({RESHARD, PLACEMENTS}),
        "torch 2.13's FSDP2 fails (IndexError in foreach_all_gather_copy_out) when an int "
        "reshard_after_forward meets a Shard(d != 0) placement; pinned by "
        "training::train_parity_raf_int_shard_dim1",
        raises="IndexError",
    ),
    Steer(
        NO_EMPTY_FLAT_UNITS,
        "torch-fsdp1",
        frozenset({ZERO_SIZE}),
        "torch 2.13's FSDP1 cannot wrap a unit whose parameters all have numel 0 (AssertionError "
        f"'{_EMPTY_UNIT}'); pinned by layout::flat_param_*[*-zero- and "
        "state_dict::local_empty_unit_round_trip",
        raises="AssertionError",
        match=_EMPTY_UNIT,
    ),
    Steer(
        NO_ZERO_WITH_MP_FLAT,
        "torch-fsdp1",
        frozenset({ZERO_SIZE, MIXED_PRECISION}),
        "with mixed precision and a wrap policy FSDP1 makes batch norms units of their own (W11), "
        "which can leave a unit of only empty parameters, which torch 2.13's FSDP1 cannot wrap",
        raises="AssertionError",
        match=_EMPTY_UNIT,
    ),
    Steer(
        NO_ONE_RANK_HYBRID_GROUP,
        "torch-fsdp1",
        frozenset({FSDP1_HSDP, TRAINING}),
        "torch 2.13's FSDP1 switches a hybrid unit whose shard group has one rank to NO_SHARD over "
        "that group and never reduces its gradients across the replicate group (each rank steps "
        "on its own gradient); pinned by fsdp1_runtime::hybrid_shard_default_groups "
        "(expectations/torch-fsdp1.cpu.txt, where the CPU's one-device nodes give such groups): "
        "training examples draw no (replicate, 1) mesh",
        raises="AssertionError",
        match="max abs difference",
    ),
)


def steers(impl) -> frozenset[str]:
    """The names of the :data:`STEERS` that apply to ``impl`` (an adapter, or the name of one
    loaded in this process): those of the deviation sets in its lineage (its name and what it
    ``inherits``)."""
    sets = set(deviation_sets(impl))
    return frozenset(s.name for s in STEERS if s.impls in sets)


def dims(ws: int, zero: bool = False):
    """A dimension below, equal to or above the world size (and 0 when ``zero``); shrinks to 1."""
    special = [1, ws, ws + 1, max(ws - 1, 1), 2 * ws + 1] + ([0] if zero else [])
    return st.one_of(st.sampled_from(special), st.integers(1, 3 * ws + 2))


@st.composite
def leaf(draw, ws: int, zero: bool) -> dict:
    kind = draw(st.sampled_from(fm.LEAF_KINDS))
    if kind == "linear":
        return {"kind": kind, "out": draw(dims(ws)), "bias": draw(st.booleans())}
    if kind == "embedding":
        return {"kind": kind, "num": draw(dims(ws))}
    if kind == "conv":
        return {
            "kind": kind,
            "channels": draw(dims(ws)),
            "k": draw(st.sampled_from([1, 3])),
            "bias": draw(st.booleans()),
        }
    if kind == "param":
        return draw(param_leaf(ws, zero))
    return {"kind": kind}


@st.composite
def param_leaf(draw, ws: int, zero: bool, force_zero: bool = False) -> dict:
    """A ``param`` leaf: a parameter of 1-3 dims (0 among them when ``zero``; one of them set to 0,
    so numel 0, when ``force_zero``), maybe with a buffer."""
    shape = draw(st.lists(dims(ws, zero=zero), min_size=1, max_size=3))
    if force_zero:
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    buffer = draw(st.sampled_from([None, "persistent", "non-persistent"]))
    return {"kind": "param", "shape": shape, "buffer": buffer}


@st.composite
def tree(draw, ws: int, depth: int, zero: bool) -> dict:
    """A ``seq`` node of 1-3 children; a child is a leaf or (while depth allows) another seq."""
    children = []
    for _ in range(draw(st.integers(1, 3))):
        if depth > 1 and draw(st.booleans()):
            children.append(draw(tree(ws, depth - 1, zero)))
        else:
            children.append(draw(leaf(ws, zero)))
    return {"kind": "seq", "children": children}


# the share of examples (of checks that may hold zero-size parameters) given one on purpose: a 0
# drawn by ``dims`` alone lands in a ``param`` leaf of only ~2-8% of examples, so the CI budget of 8
# examples would seldom hold one (see the module docstring). ``sampled_from`` shrinks toward its
# first element, so False comes first: a shrunk reproducer keeps the extra zero-size leaf only
# when the failure needs it (tests/harness/test_fuzz.py::test_shrinking_drops_an_unneeded_zero_leaf)
ZERO_SHARE = [False, True, True]


def _insert_zero_leaf(draw, node: dict, ws: int) -> None:
    """Put a numel-0 :func:`param_leaf` at a drawn position of a drawn ``seq`` node of the tree."""
    seqs, todo = [], [node]
    while todo:
        n = todo.pop()
        seqs.append(n)
        todo += [c for c in n["children"] if c["kind"] == "seq"]
    target = draw(st.sampled_from(seqs))
    at = draw(st.integers(0, len(target["children"])))
    target["children"].insert(at, draw(param_leaf(ws, zero=True, force_zero=True)))


def _tie_candidates(model) -> list[tuple[str, str]]:
    leaves = [
        (p, m)
        for p, m in model.named_modules()
        if p and isinstance(getattr(m, "weight", None), fm.nn.Parameter)
    ]
    return [
        (a, b)
        for i, (a, ma) in enumerate(leaves)
        for b, mb in leaves[i + 1 :]
        if type(ma) is type(mb)
        and ma.weight.shape == mb.weight.shape
        and not isinstance(ma, fm.BatchNormLeaf)
    ]


def _splits_tie(unit: str, ties) -> bool:
    inside = lambda path: unit == "" or path == unit or path.startswith(unit + ".")  # noqa: E731
    return any(inside(a) != inside(b) for a, b in ties)


@st.composite
def examples(draw, ws: int, impl, features=ALL_FEATURES) -> dict:
    """One example for ``impl`` at world size ``ws`` (``features``: what the check may use)."""
    caps = impl.capabilities
    known = getattr(impl, "known_options", None)
    allows = lambda opt: known is None or opt in known  # noqa: E731
    mp = None
    if MIXED_PRECISION in features and base.MIXED_PRECISION in caps and draw(st.booleans()):
        dtype = draw(st.sampled_from(["bfloat16", "float16"]))
        mp = {"param_dtype": dtype, "reduce_dtype": draw(st.sampled_from([None, "float32"]))}
        if base.FLAT_PARAM in caps:
            mp["buffer_dtype"] = draw(st.sampled_from([None, dtype]))
    steered = steers(impl)  # see the module docstring
    zero = ZERO_SIZE in features and not (
        (NO_ZERO_BACKWARD in steered and TRAINING in features and base.PER_PARAM_DIM0 in caps)
        or (NO_ZERO_WITH_MP_FLAT in steered and mp and base.FLAT_PARAM in caps)
    )
    example = {
        "seed": draw(st.integers(0, 2**16)),
        "width": draw(dims(ws)),
        "tree": draw(tree(ws, draw(st.integers(1, 4)), zero)),
        "steps": draw(st.integers(2, 3)),
    }
    if zero and draw(st.sampled_from(ZERO_SHARE)):
        _insert_zero_leaf(draw, example["tree"], ws)
    model = fm.build(example)
    if not any(p.numel() for p in model.parameters()):  # something to shard and to train
        example["tree"]["children"].append({"kind": "linear", "out": 1, "bias": True})
        model = fm.build(example)
    if TIES in features:
        candidates = _tie_candidates(model)
        if candidates and draw(st.booleans()):
            example["ties"] = [list(draw(st.sampled_from(candidates)))]
            model = fm.build(example)
    wrap = []
    if base.AUTO_WRAP in caps:
        paths = [p for p in fm.module_paths(model) if not _splits_tie(p, example.get("ties", ()))]
        wrap = sorted(draw(st.sets(st.sampled_from(paths), max_size=4)) if paths else set())
        if NO_EMPTY_FLAT_UNITS in steered and base.FLAT_PARAM in caps:
            shapes = dict((n, p.shape) for n, p in model.named_parameters())
            empty = lambda fqns: fqns and not any(fm.numel(shapes[f]) for f in fqns)  # noqa: E731
            while True:  # a dropped unit's parameters go to its parent, which may become empty
                owned = fm.managed(model, wrap + [""])
                if not any(empty(owned[u]) for u in wrap):
                    break
                wrap = [u for u in wrap if not empty(owned[u])]
            if empty(owned[""]):
                wrap = []  # the root would hold only empty parameters: shard it as one unit
    example["wrap"] = wrap
    options = {"mixed_precision": mp} if mp else {}
    if CPU_OFFLOAD in features and base.CPU_OFFLOAD in caps and allows("cpu_offload"):
        options["cpu_offload"] = draw(st.booleans())
    if ORIG_PARAMS in features and allows("use_orig_params") and base.FLAT_PARAM in caps:
        options["use_orig_params"] = draw(st.booleans())
    example["options"] = options
    if RANK0_ONLY in features and base.FULL_STATE_DICT in caps:
        example["rank0_only"] = draw(st.booleans())
    if (
        ASSIGN in features
        and {base.FSDP2_API, base.DTENSOR_STATE_DICT} <= caps
        and not example.get("ties")  # see the module docstring
    ):
        example["assign"] = draw(st.booleans())
    if (
        HSDP in features
        and base.HSDP in caps
        and allows("mesh")
        and ws in HSDP_MESHES
        and draw(st.booleans())
    ):
        example["mesh"] = list(draw(st.sampled_from(HSDP_MESHES[ws])))
    if DIVIDE_FACTOR in features and base.FSDP2_API in caps:
        factors = {
            u: draw(st.sampled_from([1.0, float(ws), 3.0]))
            for u in wrap + [""]
            if draw(st.booleans())
        }
        if factors:
            example["divide_factors"] = factors
    if PLACEMENTS in features and base.SHARD_PLACEMENT_FN in caps and allows("shard_placement_fn"):
        placements = {}
        for name, p in model.named_parameters():
            even = [d for d in range(1, p.dim()) if p.shape[d] % ws == 0]
            if even and draw(st.booleans()):
                placements[name] = draw(st.sampled_from(even))
        if placements:
            example["placements"] = placements
    if (
        RESHARD in features
        and base.RESHARD_AFTER_FORWARD in caps
        and allows("reshard_after_forward")
    ):
        values = [True, False]
        if not (NO_INT_RAF_WITH_PLACEMENTS in steered and example.get("placements")):
            values += [d for d in range(2, ws) if ws % d == 0]
        example["unit_options"] = {
            u: {"reshard_after_forward": draw(st.sampled_from(values))}
            for u in wrap + [""]
            if draw(st.booleans())
        }
    fsdp1 = {base.FLAT_PARAM, base.FSDP1_API} <= caps
    knobs = {u: {} for u in wrap + [""]}
    if STRATEGY in features and fsdp1:
        # S8 substitutes FULL with the default config for a NO_SHARD unit: what rank0_only does
        # there is left open, so an example with rank0_only shards every unit
        strategies = STRATEGIES[:2] if example.get("rank0_only") else STRATEGIES
        if (
            FSDP1_HSDP in features
            and base.FSDP1_HYBRID_SHARD in caps
            and ws in HSDP_MESHES
            and draw(st.sampled_from([False, False, True]))
        ):
            meshes = HSDP_MESHES[ws]
            if NO_ONE_RANK_HYBRID_GROUP in steered and TRAINING in features:
                meshes = [m for m in meshes if m[1] > 1]
            example["fsdp1_mesh"] = list(draw(st.sampled_from(meshes)))
            strategies = HYBRID_STRATEGIES
        for u in knobs:
            knobs[u]["sharding_strategy"] = draw(st.sampled_from(strategies))
    if PREFETCH in features and fsdp1:
        if base.FSDP1_PREFETCH in caps:
            for u in knobs:
                knobs[u]["backward_prefetch"] = draw(st.sampled_from(BACKWARD_PREFETCHES))
                knobs[u]["forward_prefetch"] = draw(st.booleans())
        limit = draw(st.sampled_from([True, False]))  # one value for the model (FSDP1 rule)
        for u in knobs:
            knobs[u]["limit_all_gathers"] = limit
    if any(knobs.values()):
        example["unit_knobs"] = knobs
    if ACCUMULATE in features and fsdp1 and base.TRAINING in caps:
        example["accumulate"] = draw(st.sampled_from(ACCUMULATIONS))
    return example
