// The scoreboard's script (included inline by scoreboard.html.j2): renders a cell's cases and the
// failure list from the JSON blob. Case rows are [column, id index, world size, outcome index,
// duration, detail index] (conformance/html/__init__.py, [Note: the page]).
(function () {
  "use strict";
  const M = JSON.parse(document.getElementById("data").textContent);
  const OUT = M.outcomes;
  const LABEL = { "pass": "pass", "fail": "fail", "xfail": "expected failure",
    "not-supported": "not supported", "skip": "skipped" };
  const ORDER = ["fail", "xfail", "skip", "pass", "not-supported"];
  const byCell = new Map();  // "column,area" -> case indices; "column,*" -> all of a column's
  const add = (key, i) => { let list = byCell.get(key); if (!list) byCell.set(key, list = []); list.push(i); };
  for (let i = 0; i < M.cases.length; i++) {
    const c = M.cases[i];
    add(c[0] + "," + M.area_of[c[1]], i);
    add(c[0] + ",*", i);
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const child of children) if (child != null) node.append(child);
    return node;
  }
  const columnName = (col) => {
    const c = M.columns[col];
    return M.runs > 1 ? c.impl + " (" + c.label + ")" : c.impl;
  };

  // a failure's cause: its last line that names an error or an assertion (as conformance.diff)
  const firstLine = (text) => {
    const lines = (text || "").split("\n").map((s) => s.trim()).filter(Boolean);
    const errors = lines.filter((s) => /Error|assert/i.test(s));
    return (errors.length ? errors[errors.length - 1] : lines[0] || "").slice(0, 240);
  };

  function copyButton(text) {
    const button = el("button", { type: "button", class: "copy", title: "copy the repro line" });
    button.textContent = "copy";
    button.addEventListener("click", async () => {
      let ok = false;
      try { await navigator.clipboard.writeText(text); ok = true; } catch (e) { ok = false; }
      if (!ok) {  // file:// pages may have no clipboard API: fall back to a selection
        const area = el("textarea", {}); area.value = text; document.body.append(area);
        area.select(); try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
        area.remove();
      }
      button.textContent = ok ? "copied" : "select and copy";
      setTimeout(() => { button.textContent = "copy"; }, 1500);
    });
    return button;
  }

  function caseBlock(i) {
    const [col, id, ws, o, duration, d] = M.cases[i];
    const outcome = OUT[o], detail = d >= 0 ? M.details[d] : {};
    const block = el("div", { class: "case", "data-id": M.ids[id], "data-outcome": outcome, "data-case": i });
    block.append(el("div", { class: "head" },
      el("span", { class: "badge o-" + outcome, text: detail.xpass ? "XPASS (fail)" : LABEL[outcome] }),
      el("code", { text: M.ids[id] }),
      el("span", { class: "small muted", text: columnName(col) + " · ws" + ws + " · " + duration + " s" })));
    if (detail.rule) block.append(el("div", { class: "small muted", text: "rule: " + detail.rule }));
    if (detail.expectation) {
      const e = detail.expectation;
      const entry = el("div", { class: "entry small" },
        el("b", { text: "expectation entry " }), el("code", { text: e.source }), " · ",
        el("code", { text: e.signature }), el("div", { text: e.reason }));
      if (e.links && e.links.length) {
        const links = el("div", {}, "upstream: ");
        e.links.forEach((link, k) => {
          if (k) links.append(", ");
          links.append(el("a", { href: link.url, text: link.label, rel: "noreferrer" }));
        });
        entry.append(links);
      }
      block.append(entry);
    }
    const ranks = detail.ranks || [];
    if (detail.message && outcome !== "xfail") {
      // the message repeats each rank's report: its cause first, the whole of it folded
      if (outcome === "fail") block.append(el("div", { class: "cause", text: firstLine(detail.message) }));
      const whole = el("details", { class: "message" },
        el("summary", { text: "message" }), el("pre", { text: detail.message }));
      whole.open = outcome !== "fail" || !ranks.length;
      block.append(whole);
    }
    let opened = false;
    for (const r of ranks) {
      const box = el("details", { class: "rank", "data-rank": r.rank },
        el("summary", { text: "rank " + r.rank + ": " + r.status + " (" + r.duration_s + " s)" }),
        el("pre", { text: r.detail || "" }));
      if (outcome === "fail" && !opened && r.status !== "ok") box.open = opened = true;
      block.append(box);
    }
    if (detail.repro) {
      block.append(el("div", { class: "repro" }, el("code", { text: detail.repro }), copyButton(detail.repro)));
    }
    if (detail.repro_script) block.append(el("div", { class: "small", text: "reproducer script: " + detail.repro_script }));
    return block;
  }

  function idList(indices) {
    const list = el("ul", { class: "ids small" });
    for (const i of indices) {
      const c = M.cases[i];
      list.append(el("li", { "data-id": M.ids[c[1]], "data-outcome": OUT[c[3]] },
        el("code", { text: M.ids[c[1]] }), " " + c[4] + " s"));
    }
    return list;
  }

  function showCell(col, area, focus) {
    const panel = document.getElementById("cases");
    document.querySelectorAll("#board td.sel").forEach((td) => td.classList.remove("sel"));
    const td = document.querySelector('#board td[data-col="' + col + '"][data-area="' + area + '"]');
    if (td) td.classList.add("sel");
    const indices = byCell.get(col + "," + area) || [];
    const groups = {};
    for (const i of indices) (groups[OUT[M.cases[i][3]]] = groups[OUT[M.cases[i][3]]] || []).push(i);
    panel.replaceChildren(el("h3", { text: columnName(col) + " · " + (area === "*" ? "all areas" : M.areas[area]) + " · " + indices.length + " cases" }));
    panel.dataset.col = col; panel.dataset.area = area;
    for (const outcome of ORDER) {
      const list = groups[outcome];
      if (!list) continue;
      const section = el("div", { class: "group", "data-outcome": outcome });
      if (outcome === "fail" || outcome === "xfail" || outcome === "skip") {
        section.append(el("h4", { text: list.length + " " + LABEL[outcome] }));
        const shown = list.length > 200 && focus === undefined ? list.slice(0, 200) : list;
        shown.forEach((i) => section.append(caseBlock(i)));
        if (shown.length < list.length) {
          const more = el("button", { type: "button", text: "show all " + list.length });
          more.addEventListener("click", () => { more.remove(); list.slice(200).forEach((i) => section.append(caseBlock(i))); });
          section.append(more);
        }
      } else if (outcome === "not-supported") {
        const byGate = {};
        for (const i of list) { const g = M.details[M.cases[i][5]].capability; (byGate[g] = byGate[g] || []).push(i); }
        for (const [gate, ids] of Object.entries(byGate)) {
          section.append(el("details", { class: "gate", "data-capability": gate },
            el("summary", {}, ids.length + " not supported: needs ", el("span", { class: "cap", text: gate })), idList(ids)));
        }
      } else {
        section.append(el("details", {}, el("summary", { text: list.length + " " + LABEL[outcome] }), idList(list)));
      }
      panel.append(section);
    }
    panel.hidden = false;
    const target = focus !== undefined ? panel.querySelector('[data-case="' + focus + '"]') : panel;
    if (target && target.scrollIntoView) target.scrollIntoView({ block: "start" });
    history.replaceState(null, "", "#cell=" + col + "," + area);
  }

  document.getElementById("board").addEventListener("click", (event) => {
    const td = event.target.closest("td.cell");
    if (td) showCell(Number(td.dataset.col), td.dataset.area === "*" ? "*" : Number(td.dataset.area));
  });

  // the failure list: every failing case, its first error line and its repro line
  const failing = [];
  for (let i = 0; i < M.cases.length; i++) if (OUT[M.cases[i][3]] === "fail") failing.push(i);
  const target = document.getElementById("failure-list");
  if (!failing.length) target.append(el("p", { text: "No case failed." }));
  const list = el("ol", {});
  const renderFailures = (from, to) => {
    for (const i of failing.slice(from, to)) {
      const [col, id, ws, , , d] = M.cases[i];
      const detail = M.details[d];
      list.append(el("li", { "data-id": M.ids[id], "data-col": col },
        el("span", { class: "linkish", text: M.ids[id], onclick: () => showCell(col, M.area_of[id], i) }),
        " on " + columnName(col) + " ",
        el("div", { class: "small muted", text: firstLine(detail.message) }),
        el("div", { class: "repro" }, el("code", { class: "small", text: detail.repro }), copyButton(detail.repro))));
    }
  };
  renderFailures(0, 300);
  target.append(list);
  if (failing.length > 300) {
    const more = el("button", { type: "button", text: "show all " + failing.length + " failures" });
    more.addEventListener("click", () => { more.remove(); renderFailures(300, failing.length); });
    target.append(more);
  }

  // the diffs' change lists: filled when their section is open (a large one when it is opened)
  function fillChanges(box) {
    const list = box.querySelector("ul.changes");
    if (list.dataset.filled) return;
    list.dataset.filled = "1";
    const key = box.dataset.section;
    for (const [impl, id, was, now, message] of M.diffs[box.dataset.diff][box.dataset.index]) {
      list.append(el("li", { class: "change", "data-section": key, "data-id": id, "data-impl": impl },
        el("code", { text: id }), " on " + impl + " ",
        el("span", { class: "arrow", text: (was || "absent") + " → " + (now || "absent") }),
        message ? el("span", { class: "small muted", text: " " + message }) : null));
    }
  }
  document.querySelectorAll("details.section[data-diff]").forEach((box) => {
    if (box.open) fillChanges(box);
    box.addEventListener("toggle", () => { if (box.open) fillChanges(box); });
  });

  const hash = /^#cell=(\d+),(\*|\d+)$/.exec(location.hash);
  if (hash) showCell(Number(hash[1]), hash[2] === "*" ? "*" : Number(hash[2]));
  document.body.dataset.ready = "1";
})();
