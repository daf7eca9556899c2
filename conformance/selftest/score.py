"""From conformance reports to the self-test's verdicts, table and mutation score (no spawning).

[Note: what counts as a catch]
A fault is *caught by* a case when the case fails on the fault while its control (the unpatched
implementation) ran the same thing and passed:

* an ordinary case: the control's record has the same case id, world size, device and backend (one
  conformance run carries both, so the run's options are the same) and passed or was an expected
  failure. With expectations looked up under the broken implementation's name, an expected failure
  that fails the documented way stays ``xfail`` (not a catch); one that fails differently or
  passes is ``fail`` (a catch);
* a fuzz case: besides, both records carry what the case ran (``fuzz``, see
  :func:`conformance.fuzz.item.ran_record`): the control passed with the same settings digest
  (check, case, world size, features after drops, budget, derandomization, timeout), and the
  examples the fault ran up to and including its first failing one are the first examples the
  control ran. The examples a case draws depend on the implementation (its capabilities, the drops
  it gets), so a fault that drew examples its control never ran may have failed on the control's
  own bug, not on the fault; such a failure is not credited. A fuzz record without ``fuzz`` cannot
  be compared and is not credited either.

The *old rule* (same case id, control passed or xfail) is computed from the same records, so the
report lists per fault the catches the old rule credited and this one does not, with the reason.
A failure whose message says the fault could not be applied (``BrokenFault``) makes the fault
BROKEN, never caught. A case the control itself fails proves nothing and is reported as a control
failure.
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
    # case id -> why the old rule (same case id) credited it and this rule does not
    withdrawn: dict[str, str] = field(default_factory=dict)
    old_caught_by: list[str] = field(default_factory=list)  # the old rule's catches, sorted
    only_fuzz_before: bool = False  # every catch under the old rule was a fuzz case

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
        if control is None or control["outcome"] not in ("pass", "xfail"):
            continue
        verdict.old_caught_by.append(rec["id"])
        reason = not_same_run(rec, control)
        if reason:
            verdict.withdrawn[rec["id"]] = reason
        else:
            verdict.caught_by.append(rec["id"])
    verdict.caught_by.sort()
    verdict.old_caught_by.sort()
    verdict.only_fuzz_before = bool(verdict.old_caught_by) and all(
        _is_fuzz(by_case[(fault.adapter_name, c)]) for c in verdict.old_caught_by
    )
    verdict.status = CAUGHT if verdict.caught_by else MISSED
    return verdict


def _is_fuzz(record: dict) -> bool:
    return "fuzz" in record or record.get("area") == "fuzz"


def not_same_run(fault_rec: dict, control: dict) -> str:
    """Why the control's record does not show that it ran what the fault's failing record ran and
    passed ('' when it does; see [Note: what counts as a catch])."""
    for key in ("world_size", "device", "backend"):
        if fault_rec.get(key) != control.get(key):
            return f"the control ran at {key} {control.get(key)!r}, the fault at {fault_rec.get(key)!r}"
    if not (_is_fuzz(fault_rec) or _is_fuzz(control)):
        return ""
    mine, theirs = fault_rec.get("fuzz"), control.get("fuzz")
    if mine is None or theirs is None:
        return "a fuzz record does not say which examples it ran"
    if control["outcome"] != "pass":
        return f"the control's fuzz case was {control['outcome']}, not pass"
    if mine["settings"] != theirs["settings"]:
        return "the control ran the fuzz case with other settings (features, drops or budget)"
    ran = mine["drawn"]
    if theirs["drawn"][: len(ran)] != ran:
        same = next(
            (i for i, (a, b) in enumerate(zip(ran, theirs["drawn"])) if a != b),
            min(len(ran), len(theirs["drawn"])),
        )
        return (
            f"the control never ran the fault's examples from #{same + 1} on "
            f"(the fault ran {len(ran)}, the control {len(theirs['drawn'])})"
        )
    return ""


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
        "rule": "control ran the same case (fuzz: same settings and examples) and passed",
        "old_rule": {
            "rule": "control passed the same case id",
            "caught": sum(bool(v.old_caught_by) for v in ran),
            "withdrawn_catches": sum(len(v.withdrawn) for v in ran),
            "faults_with_withdrawn_catches": sum(bool(v.withdrawn) for v in ran),
            "faults_only_fuzz_caught": [v.fault_id for v in ran if v.only_fuzz_before],
        },
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
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    withdrawn = [v for v in verdicts if v.withdrawn]
    if withdrawn:
        lines += ["", "credited by the old rule (same case id) only, withdrawn:"]
        for v in withdrawn:
            lines.append(
                f"  {v.fault_id}: {len(v.withdrawn)} of {len(v.old_caught_by)}"
                + (" (its only catches were fuzz cases)" if v.only_fuzz_before else "")
            )
            lines += [f"    {case}: {why}" for case, why in sorted(v.withdrawn.items())[:limit]]
            if len(v.withdrawn) > limit:
                lines.append(f"    (+{len(v.withdrawn) - limit} more; see selftest.md)")
    return lines


def score_line(stats: dict, wall: float | None = None) -> str:
    if not stats["faults"]:
        return "selftest: no fault ran"
    text = (
        f"mutation score {stats['caught']}/{stats['faults']} = {stats['score']:.0%} "
        f"({stats['missed']} missed, {stats['broken']} broken"
        + (f", {stats['not_run']} not run" if stats["not_run"] else "")
        + ")"
    )
    text += f" in {wall:.0f} s" if wall is not None else ""
    old = stats.get("old_rule")
    if old:
        text += (
            f"; old rule (same case id): {old['caught']}/{stats['faults']}, "
            f"{old['withdrawn_catches']} catch(es) of {old['faults_with_withdrawn_catches']} "
            "fault(s) withdrawn"
        )
    return text


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
    lines += [
        "",
        "A case catches a fault when it fails on the fault and the control ran the same case "
        "(same world size and options; a fuzz case: the same settings and examples) and passed.",
        "",
        "## Catches the old rule credited and this one does not",
        "",
        "The old rule credited a case failing on the fault whenever the control passed the same "
        "case id, even when a fuzz case drew examples the control never ran.",
        "",
    ]
    withdrawn = [v for v in verdicts if v.withdrawn]
    for v in withdrawn:
        lines.append(
            f"* `{v.fault_id}`: {len(v.withdrawn)} of {len(v.old_caught_by)} withdrawn"
            + (" (its only catches were fuzz cases)" if v.only_fuzz_before else "")
        )
        lines += [f"  * `{case}`: {why}" for case, why in sorted(v.withdrawn.items())]
    if not withdrawn:
        lines.append("none")
    only_fuzz = [v.fault_id for v in verdicts if v.only_fuzz_before]
    lines += ["", "## Faults whose only catches under the old rule were fuzz cases", ""]
    lines += [f"* `{f}`" for f in only_fuzz] or ["none"]
    lines += ["", "## Control (unpatched implementations)", ""]
    lines += [f"* FAILED `{c}`" for c in control_fails] or ["clean: no failures"]
    return "\n".join(lines) + "\n"
