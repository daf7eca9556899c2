"""The mutation operators of the campaign: cosmic-ray's own, narrowed, plus two it lacks.

[Note: which operators]
A mutant should look like an accidental edit. cosmic-ray's core provider offers every pairing of
its twelve binary operators (``+`` -> ``>>``, ``*`` -> ``^`` ...) and of its comparison operators;
most of those pairings are not slips anyone makes and die on a TypeError, inflating the score. The
campaign keeps:

* binary operators: the slips ``+``/``-``, ``*``/``/``, ``/``/``//``, ``//``/``*``, ``%``/``//``,
  ``**``/``*``, ``|``/``&``, ``<<``/``>>`` (both directions where listed both ways);
* comparisons: ``==``/``!=``, ``<``/``<=``, ``>``/``>=``, ``<``/``>``, ``<=``/``>=``, ``is``/``is not``;
* unary: dropping ``not``, ``-`` and ``~``;
* conditions: ``not`` added to an ``if``/``while``/``assert``/ternary test, ``and``/``or`` swapped,
  ``True``/``False`` swapped, ``break``/``continue`` swapped, a ``for`` loop over nothing;
* constants: an integer or float literal off by one (``NumberReplacer``: +1 and -1);
* a decorator removed (``@property``, ``@contextmanager``, ``@torch.no_grad()`` ...);
* and, from :class:`FsdpOperators` below (cosmic-ray has neither): a dropped statement
  (``DeleteStatement``: an assignment, a call, a ``raise``, an ``assert``, a ``del`` replaced by
  ``pass``) and a dropped return value (``ReturnNone``: ``return x`` -> ``return None``).

Left out: ``ExceptionReplacer`` (its mutants name an exception class that only exists inside
cosmic-ray's own test runner) and ``VariableReplacer``/``VariableInserter`` (they need a variable
name per run and insert random numbers, not slips).
"""

from __future__ import annotations

import parso
from cosmic_ray.operators.operator import Example, Operator

KEPT_BINARY = {
    ("Add", "Sub"),
    ("Sub", "Add"),
    ("Mul", "Div"),
    ("Div", "Mul"),
    ("Div", "FloorDiv"),
    ("FloorDiv", "Div"),
    ("FloorDiv", "Mul"),
    ("Mod", "FloorDiv"),
    ("Pow", "Mul"),
    ("BitOr", "BitAnd"),
    ("BitAnd", "BitOr"),
    ("LShift", "RShift"),
    ("RShift", "LShift"),
}
KEPT_COMPARISON = {
    ("Eq", "NotEq"),
    ("NotEq", "Eq"),
    ("Lt", "LtE"),
    ("LtE", "Lt"),
    ("Gt", "GtE"),
    ("GtE", "Gt"),
    ("Lt", "Gt"),
    ("Gt", "Lt"),
    ("LtE", "GtE"),
    ("GtE", "LtE"),
    ("Is", "IsNot"),
    ("IsNot", "Is"),
}
KEPT_CORE = {
    "ReplaceUnaryOperator_Delete_Not",
    "ReplaceUnaryOperator_Delete_USub",
    "ReplaceUnaryOperator_Delete_Invert",
    "AddNot",
    "ReplaceTrueWithFalse",
    "ReplaceFalseWithTrue",
    "ReplaceAndWithOr",
    "ReplaceOrWithAnd",
    "ReplaceBreakWithContinue",
    "ReplaceContinueWithBreak",
    "NumberReplacer",
    "RemoveDecorator",
    "ZeroIterationForLoop",
}

# statement kinds DeleteStatement may drop (parso node types directly under a simple_stmt); a
# bare call or attribute expression is an "atom_expr"/"power" node there
_DROPPABLE = {"expr_stmt", "atom_expr", "power", "raise_stmt", "assert_stmt", "del_stmt"}


def _is_docstring_or_ellipsis(node) -> bool:
    return node.type in ("string", "strings") or (node.type == "keyword" and node.value == "...")


def _is_bare_annotation(node) -> bool:
    """``name: T`` with no value: it only records an annotation (never evaluated here)."""
    ann = node.children[1] if len(node.children) > 1 else None
    return ann is not None and ann.type == "annassign" and len(ann.children) == 2


class DeleteStatement(Operator):
    """Drop one simple statement (replace it with ``pass``): a forgotten assignment, call,
    ``raise``, ``assert`` or ``del``. Imports, ``return`` (see :class:`ReturnNone`), ``pass``,
    ``global``, docstrings and bare annotations (``x: int``) are never dropped."""

    def mutation_positions(self, node):
        parent = node.parent
        if parent is not None and parent.type == "simple_stmt" and node.type in _DROPPABLE:
            if node.type == "expr_stmt" and _is_docstring_or_ellipsis(node.children[0]):
                return
            if node.type == "expr_stmt" and _is_bare_annotation(node):
                return
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        assert index == 0
        replacement = parso.parse("pass").children[0]  # the "pass" keyword leaf
        replacement.prefix = node.get_first_leaf().prefix
        return replacement

    @classmethod
    def examples(cls):
        return (
            Example("x = 1\n", "pass\n"),
            Example("f(x)\n", "pass\n"),
            Example("if a:\n    raise E\n", "if a:\n    pass\n"),
        )


class ReturnNone(Operator):
    """Return ``None`` instead of the computed value: ``return x`` -> ``return None``."""

    def mutation_positions(self, node):
        if node.type == "return_stmt" and len(node.children) == 2:
            value = node.children[1]
            if not (value.type == "keyword" and value.value == "None"):
                yield (value.start_pos, value.end_pos)

    def mutate(self, node, index):
        assert index == 0
        none = parso.parse("None").children[0]  # the "None" keyword leaf
        none.prefix = node.children[1].get_first_leaf().prefix
        node.children[1] = none
        return node

    @classmethod
    def examples(cls):
        return (Example("def f():\n    return x + 1\n", "def f():\n    return None\n"),)


class FsdpOperators:
    """A cosmic-ray operator provider (the mapping interface of its ``operator_providers``
    plugins) holding :class:`DeleteStatement` and :class:`ReturnNone`."""

    _OPERATORS = {"DeleteStatement": DeleteStatement, "ReturnNone": ReturnNone}

    def __iter__(self):
        return iter(self._OPERATORS)

    def __getitem__(self, name):
        return self._OPERATORS[name]


PROVIDER = "fsdp"


def register() -> None:
    """Add :class:`FsdpOperators` to cosmic-ray's providers as ``fsdp`` (what an installed
    ``cosmic_ray.operator_providers`` entry point would do; the campaign runs from a checkout,
    so it registers in-process)."""
    import cosmic_ray.plugins

    cosmic_ray.plugins.OPERATOR_PROVIDERS.setdefault(PROVIDER, FsdpOperators())


def selected() -> list[tuple[str, Operator]]:
    """``(full name, operator instance)`` of every operator the campaign uses, in a fixed order."""
    import cosmic_ray.plugins

    register()
    chosen = []
    for name in cosmic_ray.plugins.operator_names():
        provider, _, short = name.partition("/")
        keep = False
        if provider == PROVIDER:
            keep = True
        elif short.startswith("ReplaceBinaryOperator_"):
            keep = tuple(short.split("_")[1:]) in KEPT_BINARY
        elif short.startswith("ReplaceComparisonOperator_"):
            keep = tuple(short.split("_")[1:]) in KEPT_COMPARISON
        else:
            keep = short in KEPT_CORE
        if keep:
            chosen.append((name, cosmic_ray.plugins.get_operator(name)()))
    return chosen


def short_name(full: str) -> str:
    """``core/ReplaceComparisonOperator_Lt_LtE`` -> ``ReplaceComparisonOperator_Lt_LtE``."""
    return full.partition("/")[2]


def operator_class(full: str) -> str:
    """The operator family a score is reported by: ``binary``, ``comparison``, ``unary``,
    ``condition``, ``constant``, ``decorator``, ``statement``, ``return``."""
    short = short_name(full)
    if short.startswith("ReplaceBinaryOperator_"):
        return "binary"
    if short.startswith("ReplaceComparisonOperator_"):
        return "comparison"
    if short.startswith("ReplaceUnaryOperator_"):
        return "unary"
    return {
        "NumberReplacer": "constant",
        "ReplaceTrueWithFalse": "constant",
        "ReplaceFalseWithTrue": "constant",
        "RemoveDecorator": "decorator",
        "DeleteStatement": "statement",
        "ZeroIterationForLoop": "statement",
        "ReturnNone": "return",
    }.get(short, "condition")
