"""The HTML scoreboard's page builder (conformance/html/), without a browser: its counts, the
not-supported fold, the expectation entry and issue links, the diff of two runs, the page's
self-containment, and the report subcommand. The browser test is test_html_browser.py.

The reports here are synthetic (:func:`synthetic_run`), shaped like the records
conformance.reporting.case_record writes; every expected figure is counted from those records
directly, never from the builder's own model."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from conformance import html, reporting
from conformance.__main__ import main as conformance_main

AREAS = ("layout", "training", "state_dict", "wrap", "fsdp1_runtime", "mixed_precision")
# capability gates of the synthetic not-supported cases, per implementation
GATES = {"impl-a": (), "impl-b": ("flat-param", "fsdp1-state-dict"), "impl-c": ("per-param-dim0",)}


def synthetic_run(cases: int = 120, impls=("impl-a", "impl-b"), world_sizes=(1, 2), seed: int = 0,
                  torch: str = "2.13.0", flip=()) -> dict:  # fmt: skip
    """A conformance.json with ``cases`` cases spread over ``impls`` × ``world_sizes``: mostly
    passes, some failures (a traceback per rank, a repro line), expected failures (with their
    entry, one citing an upstream issue), skips and not-supported cases (gated by ``GATES``).
    ``flip``: (implementation, case id) pairs whose outcome turns into a failure."""
    rng = random.Random(seed)
    records = []
    per = max(1, cases // (len(impls) * len(world_sizes)))
    for impl in impls:
        for ws in world_sizes:
            for k in range(per):
                area = AREAS[k % len(AREAS)]
                cid = f"{area}::check_{k // len(AREAS)}[ws{ws}-c{k}]"
                gates = GATES.get(impl, ())
                roll = rng.random()
                if gates and area in ("state_dict", "fsdp1_runtime"):
                    outcome = "not-supported"
                elif roll < 0.06:
                    outcome = "fail"
                elif roll < 0.1:
                    outcome = "xfail"
                elif roll < 0.13:
                    outcome = "skip"
                else:
                    outcome = "pass"
                if (impl, cid) in flip:
                    outcome = "fail"
                records.append(_record(impl, ws, area, cid, outcome, gates, k))
    return {
        "tool": "fsdp-conformance", "created": "2026-12-03T10:00:00Z", "wall_time_s": 12.5,
        "torch": torch, "python": "3.11.7", "platform": "Linux-synthetic",
        "world_sizes": list(world_sizes),
        "placement": {str(ws): {"device": "cpu", "backend": "gloo"} for ws in world_sizes},
        "torchrun": False,
        "implementations": [
            {"spec": i, "name": i, "version": "1.0", "capabilities": []} for i in impls
        ],
        "command": "python -m conformance --impl " + ",".join(impls),
        "interrupted": False, "signal": None, "cases_run": len(records), "cases_not_run": 0,
        "summary": dict(Counter(r["outcome"] for r in records)),
        "stale_expectations": [],
        "cases": records,
    }  # fmt: skip


def _record(impl, ws, area, cid, outcome, gates, k) -> dict:
    message, ranks = "", []
    if outcome == "fail":
        ranks = [
            {"rank": r, "status": "error" if r == 0 else "ok", "duration_s": 0.1,
             "detail": f"Traceback (most recent call last):\n  File \"x.py\", line {k}\nAssertionError: rank {r} of {cid} </script><b>"
             if r == 0 else ""}
            for r in range(ws)
        ]  # fmt: skip
        message = f"rank 0: error (0.10 s)\n    AssertionError: expected 1.0 on rank 0 for {cid}"
    elif outcome == "xfail":
        message = (
            f"expected failure: upstream divides twice (pytorch#{1000 + k}) "
            f"[conformance/expectations/{impl}.txt:{k + 1}; raises=AssertionError match=/divided/]"
        )
    elif outcome == "skip":
        message = "skipped: needs 3 ranks"
    elif outcome == "not-supported":
        gate = gates[(k // len(AREAS)) % len(gates)]
        message = f"NotSupported: {impl} does not declare {gate}"
    return {
        "id": cid, "nodeid": f"conformance/checks/{area}.py::{cid}-{impl}", "area": area,
        "check": cid.split("::")[1].split("[")[0], "rule": "P1", "impl": impl,
        "world_size": ws, "case": f"c{k}", "device": "cpu", "backend": "gloo",
        "outcome": outcome, "duration_s": 0.25, "message": message, "ranks": ranks,
        "repro": f"python -m conformance --impl {impl} --world-sizes {ws} '{cid}-{impl}'",
    }  # fmt: skip


def expected_counts(doc) -> Counter:
    """(area, impl, world size, outcome) -> cases, counted from the records."""
    return Counter((c["area"], c["impl"], c["world_size"], c["outcome"]) for c in doc["cases"])


def test_model_counts_equal_the_records():
    doc = synthetic_run(300, impls=("impl-a", "impl-b", "impl-c"), world_sizes=(1, 2, 4))
    model = html.build_model([doc])
    want = expected_counts(doc)
    got = Counter()
    for a, area in enumerate(model["areas"]):
        for col, column in enumerate(model["columns"]):
            for ws, outcomes in model["cells"][a][col]["ws"].items():
                for outcome, n in outcomes.items():
                    got[(area, column["impl"], int(ws), outcome)] += n
    assert got == want
    totals = {c["impl"]: c["total"] for c in model["columns"]}
    for impl in ("impl-a", "impl-b", "impl-c"):
        assert totals[impl] == dict(
            Counter(c["outcome"] for c in doc["cases"] if c["impl"] == impl)
        )
    assert len(model["cases"]) == len(doc["cases"])


def test_not_supported_cells_fold_by_capability():
    doc = synthetic_run(240, impls=("impl-a", "impl-b"))
    model = html.build_model([doc])
    col = [c["impl"] for c in model["columns"]].index("impl-b")
    for area in ("state_dict", "fsdp1_runtime"):
        cell = model["cells"][model["areas"].index(area)][col]
        cases = [c for c in doc["cases"] if c["impl"] == "impl-b" and c["area"] == area]
        assert cell["folded"], f"{area} on impl-b is all not supported and must fold"
        want = Counter(c["message"].rsplit(" ", 1)[1] for c in cases)
        assert cell["gates"] == dict(want)
    assert not model["cells"][model["areas"].index("layout")][col]["folded"]
    by_gate = {g["capability"]: g for g in model["unsupported"]}
    assert set(by_gate) == set(GATES["impl-b"])
    ns = [c for c in doc["cases"] if c["outcome"] == "not-supported"]
    assert sum(g["total"] for g in model["unsupported"]) == len(ns)
    assert by_gate["flat-param"]["areas"] == ["fsdp1_runtime", "state_dict"]


def test_a_case_lacking_two_capabilities_counts_under_both():
    doc = synthetic_run(24, impls=("impl-b",), world_sizes=(1,))
    gated = [c for c in doc["cases"] if c["outcome"] == "not-supported"]
    gated[0]["message"] = "NotSupported: impl-b does not declare flat-param, hsdp"
    gated[1]["message"] = "NotSupported: impl-b does not support option(s) ['a', 'b']"
    model = html.build_model([doc])
    by_gate = {g["capability"]: g["total"] for g in model["unsupported"]}
    single = Counter(c["message"].rsplit(" ", 1)[1] for c in gated[2:])
    assert by_gate == {
        **{k: v + (k == "flat-param") for k, v in single.items()},
        "hsdp": 1,
        "option(s) ['a', 'b']": 1,
    }


def test_gate_and_entry_parse_the_plugins_messages():
    """The record's ``capability`` / ``expectation`` come from the messages conformance.plugin
    writes (the two NotSupported skips, the xfail reason with its entry)."""
    assert (
        reporting.gate_of("NotSupported: t does not declare flat-param, hsdp") == "flat-param, hsdp"
    )
    assert reporting.gate_of("NotSupported: t does not support load sharded state dict") == (
        "load sharded state dict"
    )
    assert reporting.gate_of("skipped: needs 3 ranks") == ""
    entry = reporting.expectation_of(
        "expected failure: divides twice [x] (pytorch#167178) "
        "[conformance/expectations/torch-fsdp2.txt:12; torch<2.14 raises=AssertionError match=/a; b]/]"
    )
    assert entry == {
        "reason": "divides twice [x] (pytorch#167178)",
        "source": "conformance/expectations/torch-fsdp2.txt:12",
        "signature": "torch<2.14 raises=AssertionError match=/a; b]/",
    }
    assert reporting.expectation_of("expected failure: no entry here") is None


def test_issue_links():
    links = html.issue_links(
        "fails (pytorch#188989), see also NVIDIA/apex#12 and https://x.org/i/3."
    )
    assert [link["url"] for link in links] == [
        "https://github.com/pytorch/pytorch/issues/188989",
        "https://github.com/NVIDIA/apex/issues/12",
        "https://x.org/i/3",
    ]
    assert html.issue_links("no issue found; case #3") == []


def test_xfail_details_carry_the_entry_and_link():
    doc = synthetic_run(120)
    model = html.build_model([doc])
    xfails = [i for i, c in enumerate(model["cases"]) if model["outcomes"][c[3]] == "xfail"]
    assert xfails
    detail = model["details"][model["cases"][xfails[0]][5]]
    record = next(c for c in doc["cases"] if c["id"] == model["ids"][model["cases"][xfails[0]][1]]
                  and c["outcome"] == "xfail")  # fmt: skip
    number = re.search(r"pytorch#(\d+)", record["message"])[1]
    assert detail["expectation"]["links"][0]["url"].endswith(f"/issues/{number}")
    assert detail["expectation"]["source"].startswith("conformance/expectations/")


def test_diff_of_two_runs_lists_the_changed_cases():
    old = synthetic_run(120, seed=1, torch="2.13.0")
    passing = [c["id"] for c in old["cases"] if c["impl"] == "impl-a" and c["outcome"] == "pass"]
    new = synthetic_run(120, seed=1, torch="2.14.1", flip={("impl-a", i) for i in passing[:3]})
    new["cases"] = [c for c in new["cases"] if c["id"] != passing[3]]  # vanished
    extra = dict(new["cases"][0], id="layout::brand_new[ws1-x]", outcome="pass")
    new["cases"].append(extra)  # appeared (on impl-a, the first record's impl)
    model = html.build_model([old, new])
    assert [d["title"] for d in model["diffs"]] == ["torch 2.13.0 → torch 2.14.1"]
    sections = {s["key"]: s["changes"] for s in model["diffs"][0]["sections"]}
    assert {(c["impl"], c["id"]) for c in sections["new_failures"]} == {
        ("impl-a", i) for i in passing[:3]
    }
    assert {c["id"] for c in sections["vanished"]} == {passing[3]}
    assert {c["id"] for c in sections["appeared"]} == {"layout::brand_new[ws1-x]"}
    assert ["torch", "2.13.0", "2.14.1"] in model["diffs"][0]["versions"]
    # two runs side by side: a column per (run, implementation)
    assert [(c["run"], c["impl"]) for c in model["columns"]] == [
        (0, "impl-a"), (0, "impl-b"), (1, "impl-a"), (1, "impl-b")
    ]  # fmt: skip


def test_runs_without_a_shared_implementation_have_no_diff():
    a = synthetic_run(40, impls=("impl-a", "impl-b"))
    b = synthetic_run(40, impls=("impl-c",))
    assert html.build_model([a, b])["diffs"] == []


def test_one_implementation_against_another_is_matched_by_case_id():
    """Upstream against a fork: two runs of one implementation each."""
    upstream = synthetic_run(60, impls=("impl-a",), seed=4)
    passing = [c["id"] for c in upstream["cases"] if c["outcome"] == "pass"]
    fork = synthetic_run(60, impls=("impl-a",), seed=4, flip={("impl-a", passing[0])})
    for case in fork["cases"]:
        case["impl"] = "my-fork"
    (d,) = html.build_model([upstream, fork], ["upstream", "fork"])["diffs"]
    assert d["title"] == "upstream impl-a → fork my-fork"
    sections = {s["key"]: s["changes"] for s in d["sections"]}
    assert [c["id"] for c in sections["new_failures"]] == [passing[0]]
    assert not sections["appeared"] and not sections["vanished"]


def test_page_is_self_contained_and_its_blob_is_the_cases():
    doc = synthetic_run(200)
    text = html.page([doc])
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "the page loads nothing"
    assert "<link" not in text and "@import" not in text
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)[1]
    data = json.loads(blob)
    assert len(data["cases"]) == len(doc["cases"])
    assert "</script>" not in blob  # a message holding </script> cannot end the blob
    fails = [c for c in doc["cases"] if c["outcome"] == "fail"]
    repros = {
        data["details"][c[5]]["repro"] for c in data["cases"] if data["outcomes"][c[3]] == "fail"
    }
    assert repros == {c["repro"] for c in fails}
    assert "@media print" in text


def test_report_subcommand_builds_one_page_from_two_runs(tmp_path: Path):
    first, second = tmp_path / "a", tmp_path / "b"
    for directory, torch in ((first, "2.13.0"), (second, "2.14.1")):
        directory.mkdir()
        (directory / "conformance.json").write_text(json.dumps(synthetic_run(60, torch=torch)))
    out = tmp_path / "page.html"
    assert (
        conformance_main(["report", str(first), str(second / "conformance.json"), "-o", str(out)])
        == 0
    )
    text = out.read_text()
    assert "torch 2.13.0 → torch 2.14.1" in text
    assert conformance_main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert (
        conformance_main(["report", str(first), "--label", "x", "--label", "y", "-o", str(out)])
        == 2
    )


def test_size_of_a_large_page():
    """10,000 cases × 3 runs stay under a few MB (the open time is measured in the browser test)."""
    docs = [synthetic_run(10_000, impls=("impl-a", "impl-b", "impl-c"), world_sizes=(1, 2, 4),
                          seed=s, torch=t) for s, t in ((0, "2.12.1"), (1, "2.13.0"), (2, "2.14.1"))]  # fmt: skip
    assert sum(len(d["cases"]) for d in docs) >= 29_000
    size = len(html.page(docs).encode())
    assert size < 4_000_000, f"the 10,000 x 3 page is {size / 1e6:.1f} MB"


@pytest.mark.parametrize("outcome", ["not-supported", "xfail"])
def test_case_record_holds_capability_and_entry(outcome):
    """reporting.case_record adds ``capability`` to not-supported cases and ``expectation`` to
    expected failures (from what the plugin's report says)."""

    class Spec:
        area, name, rule, requires = "layout", "c", "P1", frozenset()

    class Meta:
        case_id, spec, impl_name, world_size, case, device, backend = (
            "layout::c[ws1]",
            Spec,
            "t",
            1,
            "",
            "cpu",
            "gloo",
        )
        impl_spec, nodeid = "t", "n"
        rerun = reporting.Rerun()

    class Report:
        nodeid, duration, user_properties, failed = "n", 0.1, [], False
        skipped = outcome == "not-supported"
        longrepr = ("f", 1, "Skipped: NotSupported: t does not declare flat-param")
        wasxfail = "why (pytorch#9) [e.txt:3; raises=RuntimeError]"

    record = reporting.case_record(Report, Meta, outcome)
    if outcome == "not-supported":
        assert record["capability"] == "flat-param" and "expectation" not in record
    else:
        assert record["expectation"] == {"reason": "why (pytorch#9)", "source": "e.txt:3",
                                         "signature": "raises=RuntimeError"}  # fmt: skip


def test_an_interrupted_run_is_marked_partial():
    doc = synthetic_run(40)
    doc.update(interrupted=True, signal="SIGINT", cases_run=40, cases_not_run=7)
    text = html.page([doc])
    assert "INTERRUPTED by SIGINT: 40 case(s) ran, 7 did not run" in text
    assert "Its counts are partial" in text
    assert "INTERRUPTED" not in html.page([synthetic_run(40)])
