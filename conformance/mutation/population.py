"""The mutant population of ``reference/``, the sample a campaign draws, and each mutant's cases.

A mutant is ``(file, operator, occurrence)`` in cosmic-ray's terms: the ``occurrence``-th place,
in a pre-order walk of the file's parso tree, where ``operator`` applies. Its id spells where it is
and what it does: ``reference/_fsdp1/_flat_param.py:212:14:ReplaceComparisonOperator_Lt_LtE:0``
(file, line, column, operator, which of that operator's mutations at that spot). Ids depend only
on the file's text, so one campaign's ids are valid for as long as the file does not change;
the triage file keys on :func:`fingerprint` instead, which survives edits elsewhere in the file.

Positions inside annotations are left out of the population (the reference uses
``from __future__ import annotations``; an annotation is never evaluated, so such a mutant is
equivalent by construction; torch's FSDP files evaluate theirs once, at definition, where nothing
the suite runs reads them).

Two *targets* (``--target``): ``reference`` (``reference/``, the default) and ``torch``: the FSDP
Python sources of the torch under test (:data:`TORCH_GROUPS`), read from its installed package into
a private copy (:func:`copy_torch_sources`) whose relative paths (``torch/distributed/...``) are the
mutants' files. The installed files are never written; see :mod:`conformance.mutation.live` and
:mod:`conformance.mutation.overlay_site` for how a torch mutant is applied.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from conformance.mutation import operators

PARTS = {
    "reference/_fully_shard/": "FSDP2",
    "reference/_fsdp1/": "FSDP1 + hooks",
    "reference/api.py": "FSDP1 + hooks",  # FSDP1's configuration types (StateDictType ...)
    "reference/wrap/": "wrap",
    "reference/__init__.py": "FSDP2",  # the lazy export table; `import reference as fsdp`
}
PART_ORDER = ("FSDP2", "FSDP1 + hooks", "wrap")

# [Note: torch file groups]
# The torch target reports per group of files. Every FSDP Python file of the torch under test is
# named here (a file a later torch adds stops the campaign with a message saying to add it):
# FSDP2's runtime (state and hooks, the parameter group's unshard/reshard/reduce, the collectives,
# and FSDPModule's methods in _fully_shard.py), FSDP2's construction (fully_shard's argument
# handling, mesh/device setup, FSDPParam's sharding and its API types), FSDP1's runtime with its
# flat parameter and the shared helpers, FSDP1's state dicts and optimizer state dicts with the
# chunking helpers they use, the wrap policies, and DSD (torch.distributed.checkpoint.state_dict).
_FSDP = "torch/distributed/fsdp/"
TORCH_GROUPS = {
    _FSDP + "_fully_shard/_fsdp_state.py": "FSDP2 runtime",
    _FSDP + "_fully_shard/_fsdp_param_group.py": "FSDP2 runtime",
    _FSDP + "_fully_shard/_fsdp_collectives.py": "FSDP2 runtime",
    _FSDP + "_fully_shard/_fully_shard.py": "FSDP2 runtime",
    _FSDP + "_fully_shard/__init__.py": "FSDP2 init/params",
    _FSDP + "_fully_shard/_fsdp_init.py": "FSDP2 init/params",
    _FSDP + "_fully_shard/_fsdp_param.py": "FSDP2 init/params",
    _FSDP + "_fully_shard/_fsdp_api.py": "FSDP2 init/params",
    _FSDP + "_fully_shard/_fsdp_common.py": "FSDP2 init/params",
    _FSDP + "__init__.py": "FSDP1 runtime + flat param",
    _FSDP + "api.py": "FSDP1 runtime + flat param",
    _FSDP + "fully_sharded_data_parallel.py": "FSDP1 runtime + flat param",
    _FSDP + "_flat_param.py": "FSDP1 runtime + flat param",
    _FSDP + "_runtime_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_init_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_common_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_exec_order_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_limiter_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_traversal_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_unshard_param_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_debug_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_dynamo_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "_trace_utils.py": "FSDP1 runtime + flat param",
    _FSDP + "sharded_grad_scaler.py": "FSDP1 runtime + flat param",
    _FSDP + "_state_dict_utils.py": "FSDP1 state dicts + optim",
    _FSDP + "_optim_utils.py": "FSDP1 state dicts + optim",
    _FSDP + "_shard_utils.py": "FSDP1 state dicts + optim",
    _FSDP + "_fsdp_extensions.py": "FSDP1 state dicts + optim",
    _FSDP + "wrap.py": "wrap",
    _FSDP + "_wrap_utils.py": "wrap",
    "torch/distributed/checkpoint/state_dict.py": "DSD",
}
TORCH_GROUP_ORDER = (
    "FSDP2 runtime",
    "FSDP2 init/params",
    "FSDP1 runtime + flat param",
    "FSDP1 state dicts + optim",
    "wrap",
    "DSD",
)
TARGETS = ("reference", "torch")


def part_order(target: str = "reference") -> tuple[str, ...]:
    return TORCH_GROUP_ORDER if target == "torch" else PART_ORDER


def target_of(file: str) -> str:
    return "torch" if file.startswith("torch/") else "reference"


def part_of(file: str) -> str:
    if target_of(file) == "torch":
        if file in TORCH_GROUPS:
            return TORCH_GROUPS[file]
        raise ValueError(f"{file}: in no file group of the torch target; add it to TORCH_GROUPS")
    for prefix, part in PARTS.items():
        if file.startswith(prefix):
            return part
    raise ValueError(f"{file}: not in any part of the reference; add it to PARTS")


def module_of(file: str) -> str:
    """``torch/distributed/fsdp/_flat_param.py`` -> ``torch.distributed.fsdp._flat_param``."""
    return file[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def site_root() -> Path:
    """The directory the torch under test is installed in (its ``torch/`` lives there); found
    without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mutation: --target torch: torch is not installed in this interpreter")
    return Path(list(spec.submodule_search_locations)[0]).parent


def torch_files(root: Path) -> list[str]:
    """The torch target's files under ``root`` (an installed site or a private copy of one)."""
    fsdp = root / _FSDP
    files = [
        p.relative_to(root).as_posix() for p in fsdp.rglob("*.py") if "__pycache__" not in p.parts
    ]
    dsd = root / "torch/distributed/checkpoint/state_dict.py"
    return sorted(files + ([dsd.relative_to(root).as_posix()] if dsd.exists() else []))


def copy_torch_sources(dest: Path) -> Path:
    """Copy the torch target's files from the installed torch into ``dest`` (replacing what was
    there); only reads the installed files. Returns ``dest``."""
    import shutil

    site = site_root()
    if dest.exists():
        shutil.rmtree(dest)
    for file in torch_files(site):
        part_of(file)  # every file has a group (see [Note: torch file groups])
        (dest / file).parent.mkdir(parents=True, exist_ok=True)
        (dest / file).write_bytes((site / file).read_bytes())
    return dest


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the tree root, "/" separated
    line: int
    column: int
    operator: str  # cosmic-ray's full name, "core/NumberReplacer"
    occurrence: int

    @property
    def part(self) -> str:
        return part_of(self.file)

    def as_dict(self) -> dict:
        return asdict(self)


def reference_files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in (root / "reference").rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _annotation_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    spans = []
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        for a in found:
            spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def enumerate_file(root: Path, file: str) -> list[Mutant]:
    """Every mutant of ``file`` (relative to ``root``) under the campaign's operators."""
    from cosmic_ray.ast import ast_nodes, get_ast

    source = (root / file).read_text()
    spans = _annotation_spans(ast.parse(source))
    tree = get_ast(source)
    nodes = list(ast_nodes(tree))
    mutants = []
    for name, operator in operators.selected():
        occurrence = 0
        per_spot: dict[tuple[int, int], int] = {}
        for node in nodes:
            for start, _end in operator.mutation_positions(node):
                # parso columns count from 0, lines from 1, like ast
                inside = any(a <= start < b for a, b in spans)
                k = per_spot.get(start, 0)
                per_spot[start] = k + 1
                if not inside:
                    short = operators.short_name(name)
                    mutants.append(
                        Mutant(
                            f"{file}:{start[0]}:{start[1]}:{short}:{k}",
                            file,
                            start[0],
                            start[1],
                            name,
                            occurrence,
                        )
                    )
                occurrence += 1
    return mutants


def population(root: Path, target: str = "reference") -> list[Mutant]:
    """Every mutant of the target's files under ``root`` (the tree copy, or the torch copy)."""
    files = torch_files(root) if target == "torch" else reference_files(root)
    return [m for f in files for m in enumerate_file(root, f)]


def draw(mutants: list[Mutant], sample: int, seed: int) -> list[Mutant]:
    """``sample`` mutants drawn without replacement with ``random.Random(seed)`` (all if fewer),
    in the population's order so that a shard's share is stable."""
    if sample <= 0 or sample >= len(mutants):
        return list(mutants)
    chosen = set(random.Random(seed).sample(range(len(mutants)), sample))
    return [m for i, m in enumerate(mutants) if i in chosen]


def mutated_source(root: Path, mutant: Mutant) -> tuple[str, str]:
    """``(original, mutated)`` text of the mutant's file (cosmic-ray applies the operator)."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    operators.register()
    original = (root / mutant.file).read_text()
    mutated = mutate_code(original, get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None:
        raise ValueError(f"{mutant.id}: the operator no longer applies (the file changed?)")
    return original, mutated


def diff(original: str, mutated: str, file: str) -> str:
    import difflib

    return "\n".join(
        difflib.unified_diff(
            original.splitlines(),
            mutated.splitlines(),
            f"a/{file}",
            f"b/{file}",
            n=1,
            lineterm="",
        )
    )


def fingerprint(mutant: Mutant, original: str, mutated: str) -> str:
    """A 12-hex-digit key of what the mutant changes: file, operator, the changed lines before
    and after (stripped), and the index of that change among identical ones in the file. It stays
    the same when other parts of the file move."""
    old = original.splitlines()
    new = mutated.splitlines()
    lo = 0
    while lo < min(len(old), len(new)) and old[lo] == new[lo]:
        lo += 1
    hi_old, hi_new = len(old), len(new)
    while hi_old > lo and hi_new > lo and old[hi_old - 1] == new[hi_new - 1]:
        hi_old -= 1
        hi_new -= 1
    before = "\n".join(s.strip() for s in old[lo:hi_old])
    after = "\n".join(s.strip() for s in new[lo:hi_new])
    same = sum(1 for i, s in enumerate(old) if i < lo and s.strip() == old[lo].strip())
    key = "\0".join([mutant.file, operators.short_name(mutant.operator), before, after, str(same)])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


# --- which lines a mutant touches, for the check selection ------------------------------------


@dataclass(frozen=True)
class Reach:
    """Where a mutant's effect starts: ``lines`` (run by a case => the case is selected), or the
    whole file when ``import_time`` (module or class level: runs when the module is imported).
    ``decorator``: the change is in a function's decorator, which acts when the function is
    defined (at import) as well as through its body: ``@abstractmethod`` on a method whose body
    never runs still decides whether its class can be instantiated (see :func:`select_cases`)."""

    lines: frozenset[int]
    import_time: bool
    decorator: bool = False


@functools.lru_cache(maxsize=8)
def _parse(source: str) -> ast.AST:
    """One parse per file text: a campaign places many mutants of the same file (read-only use)."""
    return ast.parse(source)


# [Note: functions that run at import]
# A module-level function used as a decorator (``@name`` or ``@name(...)`` anywhere in the
# target's files, e.g. torch's ``_disable_functorch_if_active`` or the reference's
# ``_outside_functorch``) runs its own body while the modules it decorates are imported: before
# the trace run's tracer starts, and before a live code swap could reach it (the decorated
# functions already hold what it returned). A change in that body is placed like a module-level
# change (import time: every case of the file's part, judged in a fresh run with the file
# rewritten), never "no case executes the mutated statement". Functions nested in it (the wrapper
# it returns) run at call time and are traced as usual.


@functools.lru_cache(maxsize=4)
def called_at_import(root: Path, target: str) -> frozenset[str]:
    """The names used as decorators in the target's files under ``root`` (see the Note)."""
    files = torch_files(root) if target == "torch" else reference_files(root)
    names: set[str] = set()
    for file in files:
        for node in ast.walk(_parse((root / file).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for dec in node.decorator_list:
                    dec = dec.func if isinstance(dec, ast.Call) else dec
                    if isinstance(dec, (ast.Name, ast.Attribute)):
                        names.add(dec.id if isinstance(dec, ast.Name) else dec.attr)
    return frozenset(names)


def _decorator_body(tree: ast.AST, line: int, at_import: frozenset[str]) -> bool:
    """Whether ``line`` is in the own body of a module-level function named in ``at_import``
    (not in a function nested in it)."""
    for node in getattr(tree, "body", []):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name in at_import
            and node.body[0].lineno <= line <= node.end_lineno
        ):
            return not any(
                isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                and inner is not node
                and inner.lineno <= line <= inner.end_lineno
                for inner in ast.walk(node)
            )
    return False


def reach(source: str, line: int, at_import: frozenset[str] = frozenset()) -> Reach:
    """The lines whose execution exposes a change at ``line``.

    * inside a function body: the innermost statement containing ``line`` (a compound
      statement's header only: ``if x:`` up to its body);
    * a function's decorators or signature (defaults): the function's body lines (a decorator
      also flags ``decorator``);
    * the own body of a module-level function named in ``at_import`` (one used as a decorator,
      :func:`called_at_import`), and anything else (module or class level): import time.
    """
    tree = _parse(source)
    if at_import and _decorator_body(tree, line, at_import):
        return Reach(frozenset(), True)
    best: tuple[int, int] | None = None
    func_body: tuple[int, int] | None = None
    decorator = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body_start = node.body[0].lineno
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if first <= line < body_start:
                span = (body_start, node.end_lineno)
                if func_body is None or span[1] - span[0] < func_body[1] - func_body[0]:
                    func_body = span
                    decorator = line < node.lineno  # above the ``def`` line
        if not isinstance(node, ast.stmt) or not (node.lineno <= line <= node.end_lineno):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        end = node.end_lineno
        bodies = [getattr(node, f, None) for f in ("body", "orelse", "handlers", "finalbody")]
        firsts = [b[0].lineno for b in bodies if b]
        if firsts and line < min(firsts):
            end = min(firsts) - 1
        elif firsts:
            continue  # the line is in a nested block: a smaller statement holds it
        span = (node.lineno, end)
        if best is None or span[1] - span[0] <= best[1] - best[0]:
            best = span
    if best is not None and _in_function(tree, line):
        return Reach(frozenset(range(best[0], best[1] + 1)), False)
    if func_body is not None:
        return Reach(frozenset(range(func_body[0], func_body[1] + 1)), False, decorator)
    return Reach(frozenset(), True)


def _in_function(tree: ast.AST, line: int) -> bool:
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body[0].lineno <= line <= node.end_lineno
        for node in ast.walk(tree)
    )


def select_cases(coverage: dict[str, dict[str, list[int]]], file: str, where: Reach) -> list[str]:
    """The case ids (pytest node ids) of the coverage map that reach the mutant.

    A change at import time (module or class level) selects every case that ran any line of the
    mutated file's *part*: module-level code runs once per worker process, when the first case
    imports it, so the file's own lines name one case per worker, not the cases that use what the
    module defines (an ``__all__``, a dataclass, a constant read by another file of the part). A
    case that ran no reference line at all can only depend on such definitions: it is selected
    too (e.g. one that builds the FSDP1 configuration dataclasses, whose methods are generated).
    The torch target follows the same rule with its file groups as parts: torch's modules are
    imported before any check runs, so no case's lines name them, and the cases that ran a line
    of the file miss those that only use a generated method (``MixedPrecisionPolicy(...)`` runs
    the dataclass's ``__init__``, which has no line in the file). A change in a decorator of a
    function whose body no case runs (an ``@abstractmethod``) selects as an import-time change
    does: the decorator acted when the function was defined."""
    if where.decorator:
        ran_body = select_cases(coverage, file, Reach(where.lines, False))
        return ran_body or select_cases(coverage, file, Reach(frozenset(), True))
    if where.import_time:
        part = part_of(file)
        return [
            nodeid
            for nodeid, files in coverage.items()
            if not files or any(_in_part(f, part) for f in files)
        ]
    return [
        nodeid
        for nodeid, files in coverage.items()
        if files.get(file) and not where.lines.isdisjoint(files[file])
    ]


def _in_part(file: str, part: str) -> bool:
    try:
        return part_of(file) == part
    except ValueError:  # a file outside the reference's parts
        return False
