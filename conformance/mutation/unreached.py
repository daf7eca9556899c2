"""What no case runs: the whole mutant population's reach, without drawing a sample.

``python -m conformance.mutation.unreached --target torch`` measures the campaign's coverage maps
(the same traced runs and cache as a campaign: world sizes 1,2 and the fallback 4), places every
mutant of the population the way the campaign would (classed, or reached by the cases that execute
its statement) and reports, per file group, file and function, the mutants **no case reaches**.

[Note: reach is a ceiling, not a score]
A mutant no case executes survives every campaign, so the reached share of the counted (not
classed) population is an upper bound on any draw's score. It is measured on the whole population,
not on a sample, so reading it to decide which checks to write next leaves every seeded draw
untouched: no mutant's verdict is looked at, only where the suite never goes.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import sys
from pathlib import Path

from conformance.mutation import classes, population
from conformance.mutation.run import ROOT, copy_tree, measure_coverage


def _function_of(source: str) -> dict[int, str]:
    """line -> qualified name of the innermost function or class holding it ('<module>' else)."""
    names: dict[int, str] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                for line in range(child.lineno, child.end_lineno + 1):
                    names[line] = name
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return names


def unreached(target: str, work: Path, fallback_ws: list[int]) -> dict:
    """Every counted mutant's placement, on the coverage maps of the checkout's suite."""
    tree = work / "tree-unreached"
    copy_tree(tree)
    src = population.copy_torch_sources(work / "torch-src-unreached") if target == "torch" else tree
    maps = [measure_coverage(tree, work, [1, 2], "", target, src)]
    if fallback_ws:
        maps.append(measure_coverage(tree, work, fallback_ws, "", target, src))
    return {
        "target": target,
        "mutants": place(population.population(src, target), src, maps, target),
    }


def place(mutants, src: Path, maps: list[dict], target: str) -> list[dict]:
    """Each mutant not classed (torch target) as reached or not: reached when some case of some
    map executes its statement (:func:`population.select_cases`' rule), with its group, file and
    function."""
    # per file, the lines any case of any map executed: a statement is reached when one of its
    # lines is among them (what select_cases asks case by case, asked once)
    ran: dict[str, set[int]] = collections.defaultdict(set)
    for cov in maps:
        for files in cov["lines"].values():
            for file, lines in files.items():
                ran[file].update(lines)
    texts: dict[str, str] = {}
    funcs: dict[str, dict[int, str]] = {}
    rows = []
    for m in mutants:
        text = texts.setdefault(m.file, (src / m.file).read_text())
        if target == "torch" and (
            classes.classify(text, m.line, m.operator)
            or classes.no_caller(population.site_root(), m.file, m.line)
        ):
            continue
        where = population.reach(text, m.line, population.called_at_import(src, target))
        if where.import_time or where.decorator:
            reached = any(population.select_cases(c["lines"], m.file, where) for c in maps)
        else:
            reached = not where.lines.isdisjoint(ran[m.file])
        name = funcs.setdefault(m.file, _function_of(text)).get(m.line, "<module>")
        rows.append(
            {"id": m.id, "group": m.part, "file": m.file, "function": name, "reached": reached}
        )
    return rows


def render(data: dict, top: int) -> str:
    rows = data["mutants"]
    out = [
        f"# Reach of the {data['target']} target's counted mutants (ceiling of any draw's score)",
        "",
    ]
    by_group = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        by_group[r["group"]][0] += r["reached"]
        by_group[r["group"]][1] += 1
    out += ["| group | reached | counted | reach |", "|---|---|---|---|"]
    for g, (hit, n) in by_group.items():
        out.append(f"| {g} | {hit} | {n} | {100 * hit / n:.1f} % |")
    hit = sum(r["reached"] for r in rows)
    out += [f"| all | {hit} | {len(rows)} | {100 * hit / max(1, len(rows)):.1f} % |", ""]
    missed = collections.Counter(
        (r["group"], r["file"], r["function"]) for r in rows if not r["reached"]
    )
    out += [
        f"## The {top} functions with most unreached mutants",
        "",
        "| unreached | group | function |",
        "|---|---|---|",
    ]
    for (g, f, fn), n in missed.most_common(top):
        out.append(f"| {n} | {g} | `{f}`: `{fn}` |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m conformance.mutation.unreached", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", choices=population.TARGETS, default="reference")
    p.add_argument("--work-dir", default="reports/mutation-work")
    p.add_argument("--fallback-world-sizes", default="4")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--json", help="also write every mutant's placement here")
    args = p.parse_args(argv)
    fb = [int(w) for w in args.fallback_world_sizes.split(",") if w.strip()]
    data = unreached(
        args.target, (ROOT / args.work_dir).resolve(), [w for w in fb if w not in (1, 2)]
    )
    if args.json:
        Path(args.json).write_text(json.dumps(data))
    print(render(data, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
