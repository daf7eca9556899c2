"""Count code lines the way the project judges the reference's size: every line that holds a
token, minus docstrings and other bare string statements (the ``[Note: ...]`` blocks), comments
and blank lines.

    python tools/codelines.py reference/wrap reference/_fsdp1 reference/_fully_shard
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def code_lines(source: str) -> int:
    """Number of lines of ``source`` that carry code (see the module docstring)."""
    strings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            strings.update(range(node.lineno, node.end_lineno + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _LAYOUT and tok.type != tokenize.ENDMARKER:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in strings)
    return len(lines)


def main(paths: list[str]) -> None:
    for arg in paths:
        path = Path(arg)
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        counts = {f: code_lines(f.read_text()) for f in files}
        for f, n in counts.items():
            print(f"{n:6d} {f}")
        print(f"{sum(counts.values()):6d} {arg} (total)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["reference"])
