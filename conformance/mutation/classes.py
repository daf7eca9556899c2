"""Mutants the torch target classes instead of judging: changes CPU/gloo cannot observe by design.

[Note: classed mutants]
The suite runs on CPU with gloo. Upstream FSDP holds code no CPU run can reach or observe the
effect of: paths only a CUDA device takes, stream and event bookkeeping (on CPU the streams are
the default one and events are no-ops: dropping a ``wait_stream`` changes when work may run, never
what it computes on a single stream), branches for ``torch.compile`` / dynamo tracing and
compiled autograd (the suite runs eagerly), debug logging and profiler ranges, and decorators that
only matter to type checkers. A mutant there is not a gap of the suite's CPU checks, nor a kill:
:func:`classify` names its class, the campaign records it as ``classed`` without a run, and the
report counts each class (it is in neither side of the score). The classes, by what the mutant
changes (the innermost statement holding the mutated line, and the branches enclosing it):

* ``cuda-only``: in the branch a test of a CUDA device selects (``device.type == "cuda"``,
  ``.is_cuda``, ``torch.cuda.*``, a list of accelerator types holding ``"cuda"``), or a statement
  calling ``torch.cuda.*``, or a ``torch.library.impl`` kernel registration for an accelerator's
  dispatch key (``"XPU"``, ``"CUDA"``...);
* ``stream/event``: a bare call of ``wait_stream`` / ``record_stream`` / ``wait_event`` /
  ``record_event`` / ``synchronize`` / ``wait`` on an event, or an assignment whose every target
  names a stream or an event;
* ``compile/tracing``: in the branch ``torch.compiler.is_compiling()``, dynamo, compiled autograd
  or FX tracing selects; a statement calling into them; a decorator that turns dynamo off;
* ``debug/logging``: ``logger.debug`` / ``.info``, ``_log_api_usage_once``, a ``record_function``
  range, or a branch on the distributed debug level;
* ``typing-only``: under ``if TYPE_CHECKING:``, or a ``no_type_check`` / ``overload`` decorator;
* ``no-caller``: private code nothing in the installed torch can run (:func:`no_caller`): a
  private module of the target (``_name.py``) whose name no other torch source mentions (nothing
  imports it), or a private top-level function or class whose name occurs in torch's sources only
  where it is defined. Found by counting identifiers over every ``.py`` file of the installed
  ``torch/`` package, so a name mentioned anywhere else (a call, an import, a string in
  ``__all__``, a comment) keeps it judged: the rule can only under-class. Public names are never
  classed (a user calls them), nor is a name any conformance check mentions (the suite treats it
  as API: DSD's ``_patch_model_state_dict``, say). Methods and nested functions are never classed
  by their own name (an attribute call or a ``getattr`` can reach them); they are when their module
  or enclosing top-level function has no caller.

A statement that also computes data (a collective that is passed a stream among its arguments)
is never classed: only statements whose whole effect is one of the above are. Nor is a mutant of
such a *test* (``if device.type == "cuda"`` made ``!=``, ``not`` added to ``is_compiling()``): on
CPU it sends the eager CPU run down the other path, which the suite can observe; it is judged.
A branch is the one the test selects: the body of ``if p:``, the ``else`` of ``if not p:`` /
``if x != "cuda":``; never either branch of an ``or``.
"""

from __future__ import annotations

import ast
import collections
import functools
import re
from pathlib import Path

CUDA = re.compile(r"""["']cuda["']|\bis_cuda\b|\btorch\.cuda\.""")
COMPILE = re.compile(
    r"\bis_compiling\b|_dynamo\b|compiled_autograd|\btorch\.compiler\b|_is_fx_tracing|"
    r"is_torchdynamo_compiling|\b_is_tracing\b"
)
DEBUG = re.compile(r"debug_level|DebugLevel|\bFSDP_DEBUG\b")
STREAM_CALLS = {"wait_stream", "record_stream", "wait_event", "record_event", "synchronize"}
LOG_CALL = re.compile(
    r"^(logger|log|_logger)\.(debug|info)\(|_log_api_usage_once\(|^torch\._C\._log_api_usage"
)
ACCELERATOR_KEY = re.compile(r"""["'](CUDA|XPU|HPU|MTIA|PrivateUse1)["']""")
TYPING_DECORATORS = re.compile(r"^(typing\.)?(no_type_check|overload|override|final)$")
NO_CALLER = "no-caller"
CLASSES = (
    "cuda-only",
    "stream/event",
    "compile/tracing",
    "debug/logging",
    "typing-only",
    NO_CALLER,
)
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=2)
def _mentions(site: Path) -> tuple[collections.Counter, dict[str, set[str]]]:
    """Over every ``.py`` file of ``site``/torch: how often each identifier occurs, and in which
    files (relative, "/" separated)."""
    counts: collections.Counter = collections.Counter()
    where: dict[str, set[str]] = collections.defaultdict(set)
    for path in (site / "torch").rglob("*.py"):
        rel = path.relative_to(site).as_posix()
        try:
            words = IDENT.findall(path.read_text(errors="replace"))
        except OSError:
            continue
        counts.update(words)
        for word in set(words):
            if word.startswith("_"):  # module and private names: the ones the rule asks about
                where[word].add(rel)
    return counts, where


CHECKS = Path(__file__).resolve().parents[1] / "checks"


@functools.lru_cache(maxsize=2)
def _suite_names(checks: Path = CHECKS) -> frozenset[str]:
    """Every identifier the conformance checks' sources mention."""
    return frozenset(w for p in checks.rglob("*.py") for w in IDENT.findall(p.read_text()))


def no_caller(site: Path, file: str, line: int, checks: Path = CHECKS) -> bool:
    """Whether ``line`` of ``file`` (relative to ``site``, the directory torch is installed in)
    lies in private code nothing in the installed torch can run, and no check in ``checks``
    names (see the class in the module's Note)."""
    counts, where = _mentions(site)
    suite = _suite_names(checks)
    stem = Path(file).stem
    imported = where.get(stem, set()) - {file}
    if stem.startswith("_") and stem != "__init__" and stem not in suite and not imported:
        return True  # no other torch source names the module: nothing imports it
    for name, first, last in _top_level(site / file):
        if first <= line <= last:  # its definition is its only mention
            return name.startswith("_") and name not in suite and counts.get(name, 0) <= 1
    return False


@functools.lru_cache(maxsize=64)
def _top_level(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, first line with decorators, last line) of each top-level function and class."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.name, first, node.end_lineno))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _lines(source: str) -> list[bytes]:
    return [ln.encode() for ln in source.splitlines(keepends=True)]


def _segment(source: str, node: ast.AST) -> str:
    """``ast.get_source_segment`` without splitting the whole file on every call."""
    lines = _lines(source)[node.lineno - 1 : node.end_lineno]
    if not lines:
        return ""
    if len(lines) == 1:
        return lines[0][node.col_offset : node.end_col_offset].decode(errors="replace")
    first, last = lines[0][node.col_offset :], lines[-1][: node.end_col_offset]
    return b"".join([first, *lines[1:-1], last]).decode(errors="replace")


class _DropStrings(ast.NodeTransformer):
    """Blank every string constant but ``"cuda"`` (a message that mentions torch.cuda is not a
    CUDA path)."""

    def visit_Constant(self, node):
        if isinstance(node.value, str) and node.value != "cuda":
            return ast.copy_location(ast.Constant(""), node)
        return node


def _code_text(node: ast.AST) -> str:
    import copy

    return ast.unparse(_DropStrings().visit(copy.deepcopy(node)))


def _predicate_class(test: ast.expr, source: str) -> str | None:
    text = _code_text(test)
    if text.strip() == "TYPE_CHECKING" or text.endswith(".TYPE_CHECKING"):
        return "typing-only"
    if CUDA.search(text):
        return "cuda-only"
    if COMPILE.search(text):
        return "compile/tracing"
    if DEBUG.search(text):
        return "debug/logging"
    return None


def _statement_class(stmt: ast.stmt, source: str) -> str | None:
    compound = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.While, ast.For)
    compound += (ast.With, ast.Try)
    text = "" if isinstance(stmt, compound) else _code_text(stmt)
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in STREAM_CALLS or (name == "wait" and re.search(r"event", text, re.I)):
            return "stream/event"
        if LOG_CALL.search(text):
            return "debug/logging"
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = [_segment(source, t) or "" for t in targets]
        if names and all(re.search(r"stream|event", n, re.I) for n in names):
            return "stream/event"
    if isinstance(stmt, ast.With):  # its header only
        items = " ".join(_segment(source, i.context_expr) for i in stmt.items)
        if "record_function" in items:
            return "debug/logging"
    if CUDA.search(text):
        return "cuda-only"
    if COMPILE.search(text):
        return "compile/tracing"
    return None


def _decorator_class(dec: ast.expr, source: str) -> str | None:
    whole = _segment(source, dec) or ""
    if ACCELERATOR_KEY.search(whole) and "library.impl" in whole:
        return "cuda-only"  # a kernel registered for an accelerator's dispatch key
    text = whole.split("(")[0].strip()
    if TYPING_DECORATORS.match(text):
        return "typing-only"
    if COMPILE.search(text) or "disable_dynamo" in text or "dynamo_disable" in text:
        return "compile/tracing"
    return None


@functools.lru_cache(maxsize=8)
def _parsed(source: str):
    """The parent of every node, each line's innermost statement (a compound statement holds
    only its header lines) and each line's decorator, once per file."""
    tree = ast.parse(source)
    parents: dict[ast.AST, ast.AST] = {}
    innermost: dict[int, ast.stmt] = {}
    decorators: dict[int, ast.expr] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
        for dec in getattr(node, "decorator_list", []):
            for ln in range(dec.lineno, dec.end_lineno + 1):
                decorators[ln] = dec
        if not isinstance(node, ast.stmt):
            continue
        bodies = [getattr(node, f, None) for f in ("body", "orelse", "handlers", "finalbody")]
        firsts = [b[0].lineno for b in bodies if b and isinstance(b, list)]
        end = min(firsts) - 1 if firsts else node.end_lineno
        for ln in range(node.lineno, max(end, node.lineno) + 1):
            held = innermost.get(ln)
            if held is None or node.end_lineno - node.lineno <= held.end_lineno - held.lineno:
                innermost[ln] = node
    return parents, innermost, decorators


def classify(source: str, line: int, operator: str = "") -> str | None:
    """The class (one of :data:`CLASSES`) of a mutant at ``line`` of ``source``, or ``None``
    when it is to be judged (see the module's Note)."""
    parents, innermost, decorators = _parsed(source)
    if operator.endswith("RemoveDecorator") and line in decorators:
        return _decorator_class(decorators[line], source)
    best = innermost.get(line)
    if best is None:
        return None
    found = _statement_class(best, source)
    if found:
        return found
    node = best
    while node in parents:
        parent = parents[node]
        if isinstance(parent, (ast.If, ast.While)):
            test = parent.test
            negated = (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)) or (
                isinstance(test, ast.Compare)
                and len(test.ops) == 1
                and isinstance(test.ops[0], (ast.NotEq, ast.NotIn, ast.IsNot))
            )
            either = isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or)
            in_body = node in parent.body
            if node is not test and not either and in_body != negated:  # the branch it selects
                found = _predicate_class(parent.test, source)
                if found:
                    return found
        node = parent
    return None
