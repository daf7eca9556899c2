"""The HTML scoreboard in a real browser: headless Chromium opens the page from disk
(conformance/html/browser.py drives it over the DevTools protocol; see its note for why), and the
tests read the DOM as a user sees it. The pages are built from synthetic runs
(test_html.synthetic_run); every expected figure is counted from those records.

Without Chromium these tests skip, except under CI (``$CI`` set), where .ci/run installs it and a
missing browser is a failure, not a silent skip."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from conformance import html
from conformance.html.browser import Browser, find_chromium
from tests.harness.test_html import expected_counts, synthetic_run

if find_chromium() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI: no Chromium found; .ci/run installs Debian's chromium package")
    pytest.skip("no Chromium (apt-get install chromium, or set $CHROMIUM)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with Browser(width=1280, height=900) as b:
        yield b


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs of the same implementations (torch 2.13.0, 2.14.1): three cases of impl-a that
    passed fail in the second, one that failed passes."""
    old = synthetic_run(240, impls=("impl-a", "impl-b"), world_sizes=(1, 2), seed=3)
    passing = [c["id"] for c in old["cases"] if c["impl"] == "impl-a" and c["outcome"] == "pass"]
    new = synthetic_run(240, impls=("impl-a", "impl-b"), world_sizes=(1, 2), seed=3,
                        torch="2.14.1", flip={("impl-a", i) for i in passing[:3]})  # fmt: skip
    fixed = next(c for c in new["cases"] if c["impl"] == "impl-b" and c["outcome"] == "fail")
    fixed.update(outcome="pass", message="", ranks=[])
    path = tmp_path_factory.mktemp("page") / "two.html"
    path.write_text(html.page([old, new]))
    return old, new, path, set(passing[:3]), fixed["id"]


def test_scoreboard_counts_equal_the_json(browser, two_runs):
    old, new, path, *_ = two_runs
    browser.open(path)
    shown = browser.evaluate(
        """[...document.querySelectorAll('#board td.cell')].map(td => ({
            col: +td.dataset.col, area: td.dataset.area, folded: td.dataset.folded || null,
            counts: [...td.querySelectorAll('span.n[data-ws]')].map(
                s => [+s.dataset.ws, s.dataset.outcome, +s.textContent])}))"""
    )
    columns = browser.evaluate(
        "[...document.querySelectorAll('#board thead tr:last-child th[data-col]')]"
        ".map(th => th.firstChild.textContent)"
    )
    areas = browser.evaluate(
        "[...document.querySelectorAll('#board tbody th.area')].map(t => t.textContent)"
    )
    assert areas[0] == "all areas"
    areas = areas[1:]
    # the page's columns are run 1's implementations then run 2's, in the order each run lists them
    runs = [(0, i["name"]) for i in old["implementations"]] + [
        (1, i["name"]) for i in new["implementations"]
    ]
    assert columns == [impl for _, impl in runs]
    want = [expected_counts(old), expected_counts(new)]
    got = [Counter(), Counter()]
    totals = [Counter(), Counter()]
    for cell in shown:
        run, impl = runs[cell["col"]]
        if cell["area"] == "*":
            for ws, outcome, n in cell["counts"]:
                totals[run][(impl, ws, outcome)] += n
            continue
        area = areas[int(cell["area"])]
        if cell["folded"]:  # every case not supported: one count, the capability named
            n = sum(v for (a, i, _, o), v in want[run].items() if (a, i) == (area, impl))
            assert int(cell["folded"]) == n
            for (a, i, ws, o), v in want[run].items():
                if (a, i) == (area, impl):
                    assert o == "not-supported"
                    got[run][(a, i, ws, o)] += v
            continue
        for ws, outcome, n in cell["counts"]:
            got[run][(area, impl, ws, outcome)] += n
    assert got == want
    for run in (0, 1):
        flat = Counter()
        for (_, impl, ws, outcome), n in want[run].items():
            flat[(impl, ws, outcome)] += n
        assert totals[run] == flat


def test_folded_cell_names_its_capability(browser, two_runs):
    old, _, path, *_ = two_runs
    browser.open(path)
    folded = browser.evaluate(
        "[...document.querySelectorAll('#board td[data-folded]')].map(td => td.textContent)"
    )
    gates = {
        c["message"].rsplit(" ", 1)[1] for c in old["cases"] if c["outcome"] == "not-supported"
    }
    assert folded and all(any(g in text for g in gates) for text in folded)


def test_click_on_a_failing_cell_shows_its_repro_line(browser, two_runs):
    old, _, path, *_ = two_runs
    browser.open(path)
    col, area = browser.evaluate(
        "(() => { const td = document.querySelector('#board td.cell.s-fail:not([data-area=\"*\"])');"
        " return [td.dataset.col, td.dataset.area]; })()"
    )
    assert browser.evaluate("document.getElementById('cases').hidden") is True
    browser.click(f'#board td[data-col="{col}"][data-area="{area}"]')
    assert browser.evaluate("document.getElementById('cases').hidden") is False
    run, impl = 0, [i["name"] for i in old["implementations"]][int(col)]
    area_name = sorted({c["area"] for c in old["cases"]})[int(area)]
    failing = [
        c for c in old["cases"] if (c["impl"], c["area"], c["outcome"]) == (impl, area_name, "fail")
    ]
    assert run == 0 and failing
    shown = browser.evaluate(
        """[...document.querySelectorAll('#cases .case[data-outcome="fail"]')].map(b => ({
            id: b.dataset.id, repro: b.querySelector('.repro code').textContent,
            ranks: [...b.querySelectorAll('details.rank pre')].map(p => p.textContent),
            button: !!b.querySelector('.repro button.copy')}))"""
    )
    assert {s["id"]: s["repro"] for s in shown} == {c["id"]: c["repro"] for c in failing}
    first = next(c for c in failing if c["id"] == shown[0]["id"])
    assert shown[0]["ranks"] == [
        r["detail"] for r in first["ranks"] if r["detail"] or r["status"] != "ok"
    ]
    assert all(s["button"] for s in shown)
    # the copy button puts the repro line on the clipboard (or says to select it)
    browser.click('#cases .case[data-outcome="fail"] .repro button.copy')
    time.sleep(0.2)
    label = browser.evaluate(
        "document.querySelector('#cases .case .repro button.copy').textContent"
    )
    assert label in ("copied", "select and copy")


def test_expected_failure_shows_its_entry_and_issue_link(browser, two_runs):
    old, _, path, *_ = two_runs
    browser.open(path)
    xfail = next(c for c in old["cases"] if c["outcome"] == "xfail")
    col = [i["name"] for i in old["implementations"]].index(xfail["impl"])
    area = sorted({c["area"] for c in old["cases"]}).index(xfail["area"])
    browser.click(f'#board td[data-col="{col}"][data-area="{area}"]')
    entry = browser.evaluate(
        f"""(() => {{ const b = document.querySelector('#cases .case[data-id={json.dumps(xfail["id"])}][data-outcome="xfail"]');
        return {{ text: b.querySelector('.entry').textContent,
                 links: [...b.querySelectorAll('.entry a')].map(a => a.href) }}; }})()"""
    )
    source = xfail["message"].rsplit("[", 1)[1].split(";")[0]
    number = xfail["message"].split("pytorch#")[1].split(")")[0]
    assert source in entry["text"] and "raises=AssertionError" in entry["text"]
    assert entry["links"] == [f"https://github.com/pytorch/pytorch/issues/{number}"]


def test_diff_view_lists_the_changed_cases(browser, two_runs):
    _, _, path, new_failures, fixed = two_runs
    browser.open(path)
    changes = browser.evaluate(
        "[...document.querySelectorAll('#changes li.change')].map(li => "
        "[li.dataset.section, li.dataset.impl, li.dataset.id])"
    )
    listed = Counter(section for section, _, _ in changes)
    assert {(impl, cid) for s, impl, cid in changes if s == "new_failures"} == {
        ("impl-a", cid) for cid in new_failures
    }
    assert [(impl, cid) for s, impl, cid in changes if s == "fixed"] == [("impl-b", fixed)]
    assert set(listed) == {"new_failures", "fixed"}
    versions = browser.evaluate("document.querySelector('#changes .diff').textContent")
    assert "torch 2.13.0 → torch 2.14.1" in versions


def test_a_large_page_opens_in_under_a_second(browser, tmp_path):
    """10,000 cases × 3 runs: the page's size and the time until its script has rendered it
    (wall time, so a loaded machine reads slower: the bound leaves room for that)."""
    docs = [synthetic_run(10_000, impls=("impl-a", "impl-b", "impl-c"), world_sizes=(1, 2, 4),
                          seed=s, torch=t) for s, t in ((0, "2.12.1"), (1, "2.13.0"), (2, "2.14.1"))]  # fmt: skip
    path = tmp_path / "large.html"
    path.write_text(html.page(docs))
    best = min(browser.open(path) for _ in range(2))
    size = path.stat().st_size
    print(f"10,000 x 3 page: {size / 1e6:.2f} MB, opened in {best:.2f} s")
    assert size < 4_000_000
    assert best < 3.0, f"the 10,000 x 3 page took {best:.2f} s to open"
    assert browser.evaluate("document.querySelectorAll('#board td.cell').length") > 0
