"""From conformance reports to the self-test's verdicts, table and mutation score (no spawning).

[Note: what counts as a catch]
A fault is *caught by* a case when the case's outcome on the fault is ``fail`` while the same case
(id) on the unpatched implementation passed or was an expected failure: with expectations looked
up under the broken implementation's name, an expected failure that fails the documented way stays
``xfail`` (not a catch), one that fails differently or passes is ``fail`` (a catch). A failure
whose message says the fault could not be applied (``BrokenFault``) makes the fault BROKEN, never
caught. A case the control itself fails proves nothing and is reported as a control failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CAUGHT, MISSED, BROKEN, NOT_RUN = "caught", "MISSED", "BROKEN", "not run"
BROKEN_MARK = "BrokenFault"


@dataclass
class Verdict:
    fault_id: str
    impl: str
    behaviour: str
    area: str
    description: str
    world_sizes: list[int]
    status: str = NOT_RUN
    caught_by: list[str] = field(default_factory=list)  # case ids, sorted
    detail: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def index(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(implementation name, case id) -> record."""
    return {(r["impl"], r["id"]): r for r in records}


def judge(fault, records: list[dict], world_sizes: list[int]) -> Verdict:
    """The verdict for one fault from the records of the runs it was in (``world_sizes``)."""
    verdict = Verdict(
        fault.id, fault.impl, fault.behaviour, fault.area, fault.description, list(world_sizes)
    )
    if not world_sizes:
        verdict.detail = f"needs world size {'/'.join(map(str, fault.world_sizes))}"
        return verdict
    by_case = index(records)
    control_name = fault.impl
    mine = [r for r in records if r["impl"] == fault.adapter_name]
    if not mine:  # its run failed (the run's problem is reported on its own)
        verdict.detail = "no case ran"
        return verdict
    broken = [r for r in mine if r["outcome"] == "fail" and BROKEN_MARK in (r.get("message") or "")]
    if broken:
        verdict.status = BROKEN
        verdict.detail = _broken_reason(broken[0]["message"])
        return verdict
    for rec in mine:
        if rec["outcome"] != "fail":
            continue
        control = by_case.get((control_name, rec["id"]))
        if control is not None and control["outcome"] in ("pass", "xfail"):
            verdict.caught_by.append(rec["id"])
    verdict.caught_by.sort()
    verdict.status = CAUGHT if verdict.caught_by else MISSED
    return verdict


def _broken_reason(message: str) -> str:
    for line in message.splitlines():
        if BROKEN_MARK in line:
            return line.strip()
    return "the fault could not be applied"


def control_failures(records: list[dict], controls: set[str]) -> list[str]:
    """``impl case-id`` of every failed case of an unpatched implementation."""
    return sorted(
        f"{r['impl']} {r['id']}"
        for r in records
        if r["impl"] in controls and r["outcome"] == "fail"
    )


def summary(verdicts: list[Verdict]) -> dict:
    ran = [v for v in verdicts if v.status != NOT_RUN]
    caught = sum(v.status == CAUGHT for v in ran)
    return {
        "faults": len(ran),
        "caught": caught,
        "missed": sum(v.status == MISSED for v in ran),
        "broken": sum(v.status == BROKEN for v in ran),
        "not_run": len(verdicts) - len(ran),
        "score": round(caught / len(ran), 4) if ran else None,
    }


def exit_code(verdicts: list[Verdict], control_fails: list[str]) -> int:
    """0 when every fault that ran was caught and the controls are clean; else 1."""
    bad = any(v.status in (MISSED, BROKEN) for v in verdicts)
    return 1 if bad or control_fails else 0


def _cases(ids: list[str], limit: int) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def table_lines(verdicts: list[Verdict], limit: int = 3) -> list[str]:
    """A plain-text table: one line per fault."""
    rows = [("fault", "breaks", "rule", "ws", "result")]
    for v in verdicts:
        result = {CAUGHT: f"caught by {len(v.caught_by)}: {_cases(v.caught_by, limit)}"}.get(
            v.status, v.status + (f" ({v.detail})" if v.detail else "")
        )
        rows.append(
            (v.fault_id, v.impl, v.behaviour, ",".join(map(str, v.world_sizes)) or "-", result)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]


def score_line(stats: dict, wall: float | None = None) -> str:
    if not stats["faults"]:
        return "selftest: no fault ran"
    text = (
        f"mutation score {stats['caught']}/{stats['faults']} = {stats['score']:.0%} "
        f"({stats['missed']} missed, {stats['broken']} broken"
        + (f", {stats['not_run']} not run" if stats["not_run"] else "")
        + ")"
    )
    return text + (f" in {wall:.0f} s" if wall is not None else "")


def markdown(
    verdicts: list[Verdict], stats: dict, control_fails: list[str], wall: float | None = None
) -> str:
    lines = [
        "# Conformance self-test: seeded faults",
        "",
        f"**{score_line(stats, wall)}**",
        "",
        "| fault | breaks | rule | area | world sizes | result | description |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        result = (
            (
                f"caught by {len(v.caught_by)}: "
                + ", ".join(f"`{c}`" for c in v.caught_by[:5])
                + (" …" if len(v.caught_by) > 5 else "")
            )
            if v.status == CAUGHT
            else (f"**{v.status}**" + (f" ({v.detail})" if v.detail else ""))
        )
        lines.append(
            f"| `{v.fault_id}` | {v.impl} | {v.behaviour} | {v.area} | "
            f"{','.join(map(str, v.world_sizes)) or '-'} | {result} | {v.description} |"
        )
    lines += ["", "## Control (unpatched implementations)", ""]
    lines += [f"* FAILED `{c}`" for c in control_fails] or ["clean: no failures"]
    return "\n".join(lines) + "\n"
