"""The mutation campaign (``conformance/mutation``): its pure parts, and a tiny campaign end to end.

The tiny campaign is what CI runs (``nox -s tests`` installs cosmic-ray for it): a handful of
mutants of one small file, a fixed seed, the cases narrowed to one area, world size 2 only. It
proves the pipeline (copy, trace, mutate, select, judge, resume, report) and that the checkout is
never written; the full campaign is ``nox -s mutation``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray", reason="the mutation engine (nox -s tests installs it)")

from conformance.mutation import operators, population, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_wilson_interval_matches_the_closed_form():
    # k = 0 of n: the upper bound is z^2 / (n + z^2)
    z = 1.959964
    lo, hi = report.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(z * z / (10 + z * z), rel=1e-6)
    lo, hi = report.wilson(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(10 / (10 + z * z), rel=1e-6)
    lo, hi = report.wilson(180, 200)
    assert lo < 0.9 < hi and lo > 0.84 and hi < 0.94


@pytest.mark.parametrize("cls", [operators.DeleteStatement, operators.ReturnNone])
def test_added_operators_make_their_examples(cls):
    from cosmic_ray.mutating import mutate_code

    for ex in cls.examples():
        assert mutate_code(ex.pre_mutation_code, cls(), ex.occurrence) == ex.post_mutation_code


def test_statement_deletion_spares_docstrings_imports_and_returns():
    from cosmic_ray.mutating import mutate_code

    source = 'def f():\n    """doc"""\n    import os\n    return os.sep\n'
    assert mutate_code(source, operators.DeleteStatement(), 0) is None


def test_operator_set_has_each_family():
    families = {operators.operator_class(name) for name, _ in operators.selected()}
    assert families == {
        "binary",
        "comparison",
        "unary",
        "condition",
        "constant",
        "decorator",
        "statement",
        "return",
    }


SOURCE = """\
import math

LIMIT = 3


@decorate
def f(x, y=2):
    total = 0
    if x > LIMIT and y:
        total = x + 1
    for i in range(x):
        total += i
    return total
"""


def test_reach_maps_a_mutant_to_the_lines_that_expose_it():
    assert population.reach(SOURCE, 10).lines == {10}  # a simple statement
    assert population.reach(SOURCE, 9).lines == {9}  # an if's header, not its body
    assert population.reach(SOURCE, 11).lines == {11}  # a for's header
    assert population.reach(SOURCE, 7).lines == set(range(8, 14))  # a default: the body
    assert population.reach(SOURCE, 6).lines == set(range(8, 14))  # the decorator: the body
    assert population.reach(SOURCE, 3).import_time  # module level


DECORATOR_SOURCE = """\
def outside(fn):
    marker = 1

    def run(*args):
        return fn(*args)

    return run


@outside
def g():
    return 2
"""


def test_a_decorator_functions_own_body_runs_at_import():
    # [Note: functions that run at import]: the decorator's own lines are import-time changes, the
    # wrapper it returns runs at call time, and without the names the rule is the usual one
    at_import = frozenset({"outside"})
    assert population.reach(DECORATOR_SOURCE, 2, at_import).import_time
    assert population.reach(DECORATOR_SOURCE, 7, at_import).import_time
    assert population.reach(DECORATOR_SOURCE, 5, at_import).lines == {5}
    assert population.reach(DECORATOR_SOURCE, 12, at_import).lines == {12}
    assert population.reach(DECORATOR_SOURCE, 7).lines == {7}


def test_called_at_import_finds_the_decorators_of_the_files(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "m.py").write_text(
        DECORATOR_SOURCE + "\n@a.b(1)\ndef h():\n    pass\n"
    )
    assert population.called_at_import(tmp_path, "reference") == {"outside", "b"}


def test_selection_takes_the_cases_that_ran_the_lines():
    x, y = "reference/wrap/x.py", "reference/wrap/y.py"  # one part
    cov = {
        "a": {x: [9, 10]},
        "b": {x: [8]},
        "c": {"other": [9]},
        "d": {y: [1]},  # ran nothing of x: its import happened in an earlier case
        "e": {"reference/_fsdp1/z.py": [9]},  # another part
        "f": {},  # ran no reference line: it can only use what modules define at import
    }
    assert population.select_cases(cov, x, population.reach(SOURCE, 9)) == ["a"]
    # a module-level change: every case that ran anything of the file's part
    whole = population.reach(SOURCE, 3)
    assert population.select_cases(cov, x, whole) == ["a", "b", "d", "f"]
    # a decorator: the cases that ran the body, else (an abstract method's body never runs)
    # every case of the part, since it acted when the function was defined
    decorated = population.reach(SOURCE, 6)
    assert decorated.decorator and not population.reach(SOURCE, 7).decorator
    assert population.select_cases(cov, x, decorated) == ["a", "b"]
    unrun = {k: v for k, v in cov.items() if k not in ("a", "b")}
    assert population.select_cases(unrun, x, decorated) == ["d", "f"]


def test_a_torch_class_level_mutant_runs_every_case_of_its_group():
    # a dataclass's generated __init__ has no line in its file: the cases that build
    # MixedPrecisionPolicy ran lines of other files of the group only, and must run too
    api = "torch/distributed/fsdp/_fully_shard/_fsdp_api.py"
    param = "torch/distributed/fsdp/_fully_shard/_fsdp_param.py"
    state = "torch/distributed/fsdp/_fully_shard/_fsdp_state.py"
    assert population.part_of(api) == population.part_of(param) != population.part_of(state)
    cov = {
        "ran-the-file": {api: [40]},
        "same-group": {param: [200]},
        "other-group": {state: [300]},
        "no-fsdp-line": {},
    }
    class_level = population.Reach(frozenset(), True)
    assert population.select_cases(cov, api, class_level) == [
        "ran-the-file",
        "same-group",
        "no-fsdp-line",
    ]


def test_unreached_places_each_mutant_by_the_lines_the_cases_ran(tmp_path):
    from conformance.mutation import unreached

    (tmp_path / "reference" / "wrap").mkdir(parents=True)
    (tmp_path / "reference" / "wrap" / "x.py").write_text(SOURCE)
    x = "reference/wrap/x.py"
    at = {
        line: population.Mutant(f"{x}:{line}", x, line, 0, "core/NumberReplacer", 0)
        for line in (10, 9, 3)
    }
    cov = {"lines": {"a": {x: [9]}, "b": {}}}
    rows = unreached.place(list(at.values()), tmp_path, [cov], "reference")
    got = {r["id"]: (r["reached"], r["function"], r["group"]) for r in rows}
    part = population.part_of(x)
    assert got[f"{x}:9"] == (True, "f", part)  # the if's header ran
    assert got[f"{x}:10"] == (False, "f", part)  # its body did not
    # module level: case "b" ran no reference line (import-time rule)
    assert got[f"{x}:3"][0] is True
    text = unreached.render({"target": "reference", "mutants": rows}, top=5)
    assert "| all | 2 | 3 | 66.7 % |" in text and "| 1 | " in text


def test_annotations_are_not_mutated(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "m.py").write_text("def f(x: int | None) -> int | None:\n    pass\n")
    assert population.enumerate_file(tmp_path, "reference/m.py") == []


def test_draw_is_seeded_and_shards_partition_it():
    everything = population.population(ROOT)
    first = population.draw(everything, 30, 7)
    assert first == population.draw(everything, 30, 7)
    assert first != population.draw(everything, 30, 8)
    shares = [first[i::3] for i in range(3)]
    assert sorted(m.id for s in shares for m in s) == sorted(m.id for m in first)
    assert {m.part for m in everything} == set(population.PART_ORDER)


def test_fingerprint_survives_a_shift_elsewhere_in_the_file(tmp_path):
    (tmp_path / "reference").mkdir()
    path = tmp_path / "reference" / "m.py"
    body = "def f(x):\n    return x + 1\n"
    path.write_text(body)
    m1 = [m for m in population.enumerate_file(tmp_path, "reference/m.py") if "Add_Sub" in m.id][0]
    fp1 = population.fingerprint(m1, *population.mutated_source(tmp_path, m1))
    path.write_text("import os\n\n\n" + body)
    m2 = [m for m in population.enumerate_file(tmp_path, "reference/m.py") if "Add_Sub" in m.id][0]
    assert m2.line == m1.line + 3
    assert population.fingerprint(m2, *population.mutated_source(tmp_path, m2)) == fp1


def test_triage_entries_need_a_reason(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text('[[equivalent]]\nfingerprint = "abc"\n')
    with pytest.raises(SystemExit, match="needs a fingerprint and a reason"):
        report.load_triage(bad)
    assert report.load_triage(ROOT / "conformance" / "mutation" / "triage.toml") is not None


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((root / "reference").rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()


TINY = [
    "--sample",
    "3",
    "--seed",
    "4",
    "--files",
    "reference/_fully_shard/_shard_math.py",
    "--checks",
    "layout and dim0",
    "--world-sizes",
    "2",
]


def test_tiny_campaign_end_to_end(tmp_path):
    """Three mutants of the sharding arithmetic, judged by the layout cases at world size 2: with
    seed 4, two in function bodies (judged in one shared run, by a code swap) and one in a
    default argument (judged in a fresh run with the file rewritten in the copy).

    It runs from a copy of the checkout (others may edit the real one meanwhile), whose
    ``reference/`` must come out byte for byte as it went in."""
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("reference", "conformance"):
        shutil.copytree(ROOT / name, checkout / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    before = _digest(checkout)
    cmd = [
        sys.executable,
        "-m",
        "conformance.mutation",
        *TINY,
        "--work-dir",
        str(tmp_path / "work"),
        "--reports-dir",
        str(tmp_path),
    ]
    run = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _digest(checkout) == before, "the campaign wrote into the checkout's reference/"
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"mutation score: \d+/\d+ = (\d+\.\d%|n/a) \(survivors triaged \d+/\d+\)", last
    ), last
    data = json.loads((tmp_path / "mutation.json").read_text())
    for key in ("sample", "seed", "killed", "survived", "timeout", "incompetent", "score"):
        assert key in data
    assert data["sample"] == 3 and data["seed"] == 4 and data["pending"] == 0
    judged = data["killed"] + data["survived"] + data["timeout"] + data["incompetent"]
    assert judged + data["error"] == 3 and data["error"] == 0
    assert data["killed"] >= 1, data  # the layout cases see off-by-one arithmetic
    for s in data["survivors"]:
        assert {"id", "file", "line", "operator", "diff", "triage"} <= set(s)
    (session,) = (tmp_path / "work").glob("session-*.jsonl")
    records = [json.loads(line) for line in session.read_text().splitlines()]
    assert {r["run"] for r in records} == {"live", "process"}, records
    # rerunning the same command resumes: nothing is judged twice
    again = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "already judged 3" in again.stdout
    assert "mutation: [" not in again.stdout
    # the same draw found again by fingerprint, in a new session that carries the old one's
    # verdicts: only the old survivors are judged
    carried = [r for r in records if r["status"] != "survived"]
    cmd2 = cmd[:-4] + ["--work-dir", str(tmp_path / "work2"), "--reports-dir", str(tmp_path / "r2")]
    third = subprocess.run(
        [*cmd2, "--draw-from", str(session), "--carry", str(session)],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "--draw-from: 3 of its 3 mutants found again" in third.stdout, third.stdout
    assert f"--carry: {len(carried)} verdict(s) taken over unjudged" in third.stdout
    assert third.stdout.count("mutation: [") == 3 - len(carried), third.stdout
    data2 = json.loads((tmp_path / "r2" / "mutation.json").read_text())
    assert data2["carried"] == len(carried) and data2["score"] == data["score"], data2


def test_each_mutant_of_a_shared_run_gets_a_fresh_worker_group(tmp_path, monkeypatch):
    """[Note: one group per mutant]: the batch plugin closes the group whenever the next case
    belongs to another mutant (and never between one mutant's own cases)."""
    from types import SimpleNamespace

    from conformance import plugin
    from conformance.mutation import live

    batch = tmp_path / "batch.json"
    ids = {"m0": {"id": "a.py:1"}, "m1": {"id": "a.py:2"}, "m2": {"id": "b.py:7"}}
    batch.write_text(json.dumps({"adapters": ids, "order": []}))
    monkeypatch.setenv(live.BATCH_ENV, str(batch))
    closed = []
    fake_session = SimpleNamespace(close_group=lambda: closed.append(live._current[0]))
    monkeypatch.setattr(plugin, "session_of", lambda config: fake_session)
    monkeypatch.setattr(live, "_current", [None])
    monkeypatch.setattr(live, "_killed", {"a.py:2"})
    if hasattr(live._mutant_of, "ids"):
        monkeypatch.delattr(live._mutant_of, "ids")
    nodes = ["x[mutant-0-ws1]", "y[mutant-0-ws1]", "x[mutant-1-ws1]", "x[mutant-2-ws1]"]
    nodes += ["z[mutant-2-ws1]", "x[mutant-0-ws2]", "x[reference-ws2]"]
    for nodeid in nodes:
        try:
            live.pytest_runtest_setup(SimpleNamespace(nodeid=nodeid, config=None))
        except pytest.skip.Exception:
            assert "mutant-1" in nodeid  # the killed mutant's case: skipped, no group work
    # closed when mutant 2 follows mutant 0 (mutant 1 was skipped) and when mutant 0 follows 2
    assert closed == ["a.py:1", "b.py:7"]


def test_kill_order_takes_one_case_per_check_first():
    from conformance.mutation.run import _kill_order

    cases = ["a.py::x[r-ws1-1]", "a.py::x[r-ws1-2]", "a.py::y[r-ws1-1]", "b.py::z[r-ws2-1]"]
    duration = {cases[0]: 0.3, cases[1]: 0.1, cases[2]: 0.5, cases[3]: 0.2}
    assert _kill_order(cases, duration) == [cases[1], cases[3], cases[2], cases[0]]


def test_a_killed_entry_names_its_check(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[[killed]]\nfingerprint = "abc"\nby = "area::check[case]"\n')
    record = {
        "status": "survived",
        "fingerprint": "abc",
        "part": "wrap",
        "operator": "core/NumberReplacer",
        "seconds": 1.0,
        "cases": 1,
    }
    summary = report.summarise([record], report.load_triage(path))
    assert summary["scored"] == 1 and summary["killed"] == 0  # still a survivor of its session
    assert report._survivor_entry(
        record | {"id": "i", "file": "f", "line": 1, "diff": "", "note": ""}
    )["triage"].startswith("killed by area::check[case]")


def test_a_classed_entry_leaves_the_score_and_counts_in_its_class(tmp_path):
    """[Note: triage], ``classed``: a survivor classed cuda-only in triage leaves M like an
    equivalent one and shows in the classed table as ``cuda-only (triage)``; an unknown class is
    refused."""
    path = tmp_path / "t.toml"
    path.write_text(
        '[[classed]]\nfingerprint = "abc"\ntarget = "torch"\nclass = "cuda-only"\n'
        'why = "device_id=cuda only"\n'
    )
    base = {"part": "wrap", "operator": "core/NumberReplacer", "seconds": 1.0, "cases": 1}
    records = [
        base | {"status": "survived", "fingerprint": "abc"},
        base | {"status": "survived", "fingerprint": "def"},
        base | {"status": "killed", "fingerprint": "ghi"},
    ]
    summary = report.summarise(records, report.load_triage(path, "torch"), "torch")
    assert (summary["killed"], summary["scored"]) == (1, 2)
    assert summary["classed"] == {"cuda-only (triage)": {"wrap": 1}}
    entry = report._survivor_entry(
        records[0] | {"id": "i", "file": "f", "line": 1, "diff": "", "note": ""}
    )
    assert entry["triage"] == "classed cuda-only: device_id=cuda only"
    path.write_text('[[classed]]\nfingerprint = "a"\nclass = "hard"\nwhy = "x"\n')
    with pytest.raises(SystemExit, match="class 'hard' of a: expected one of cuda-only"):
        report.load_triage(path)


def test_a_statement_no_main_case_runs_is_judged_at_the_fallback_world_sizes():
    """[Note: fallback world sizes]: with no case at the main world sizes executing the mutated
    statement, ``prepare`` asks for the fallback map once and takes its cases; with none there
    either, the mutant survives unjudged."""
    from conformance.mutation.run import prepare

    file = "reference/_fully_shard/_shard_math.py"
    mutant = next(
        m for m in population.enumerate_file(ROOT, file) if m.operator.endswith("Sub_Add")
    )
    line = mutant.line
    asked = []

    def fallback(lines):
        def get():
            asked.append(1)
            return {"lines": lines, "duration": {"f[r-ws4-a]": 1.0}, "ws": "4"}

        return get

    empty = {"lines": {}, "duration": {}}
    prep = prepare(mutant, ROOT, empty, fallback({"f[r-ws4-a]": {file: [line]}}))
    assert prep["cases"] == ["f[r-ws4-a]"] and asked == [1], prep
    assert prep["record"]["note"] == "judged at the fallback world sizes 4"
    prep = prepare(mutant, ROOT, {"lines": {}, "duration": {}}, fallback({}))
    assert prep["record"]["status"] == "survived", prep
    assert prep["record"]["note"] == "no case executes the mutated statement"
    main = {"lines": {"f[r-ws2-a]": {file: [line]}}, "duration": {}}
    asked.clear()
    prep = prepare(mutant, ROOT, main, fallback({"f[r-ws4-a]": {file: [line]}}))
    assert prep["cases"] == ["f[r-ws2-a]"] and not asked
    # a main-pass survivor's second look: the fallback cases executing the same statement
    assert prep["second_look"]() == ["f[r-ws4-a]"] and asked == [1]


def test_a_main_pass_survivor_killed_at_the_fallback_sizes_is_killed():
    """[Note: fallback world sizes]: the second look's verdict replaces a survivor's when it
    kills; a second survival keeps the first record with both passes counted in its note."""
    from conformance.mutation.run import second_look

    first = {"status": "survived", "note": "3 case(s) passed or skipped", "seconds": 2.0}
    killed = {"status": "killed", "note": "", "seconds": 5.0, "killer": "f[r-ws4-a]"}
    got = second_look(first, killed, "4")
    assert (got["status"], got["killer"], got["seconds"]) == ("killed", "f[r-ws4-a]", 7.0)
    assert got["note"].startswith("killed at the fallback world sizes 4")
    alive = {"status": "survived", "note": "1 case(s) passed", "seconds": 1.0, "cases": 1}
    got = second_look(first, alive, "4")
    assert got["status"] == "survived" and got["seconds"] == 3.0
    assert got["note"] == "3 case(s) passed or skipped; 1 more at the fallback world sizes 4"


def test_session_files_take_absolute_globs_and_name_a_missing_file(tmp_path):
    from conformance.mutation.run import session_files

    for name in ("session-a-1of1.jsonl", "session-b-1of1.jsonl"):
        (tmp_path / name).write_text("")
    found = session_files(f"{tmp_path}/session-*.jsonl", "--carry")
    assert [p.name for p in found] == ["session-a-1of1.jsonl", "session-b-1of1.jsonl"]
    with pytest.raises(SystemExit, match="--carry .*: no such session file"):
        session_files(str(tmp_path / "nope.jsonl"), "--carry")


# --- the torch target (``--target torch``) ------------------------------------------------


def test_every_torch_fsdp_file_has_a_group():
    """[Note: torch file groups]: each FSDP file of the installed torch is in one of the six
    groups, and every group holds a file."""
    files = population.torch_files(population.site_root())
    assert "torch/distributed/checkpoint/state_dict.py" in files
    assert any(f.startswith("torch/distributed/fsdp/_fully_shard/") for f in files)
    groups = {population.part_of(f) for f in files}  # raises for a file in no group
    assert groups == set(population.TORCH_GROUP_ORDER)


CLASSED = """\
import torch


def f(device, stream, x, group):
    if device.type == "cuda":
        x = x.pin_memory()
    if not torch.compiler.is_compiling():
        y = x + 1
    else:
        y = x * 2
    if device.type != "cuda":
        z = x - 1
    else:
        z = x + 2
    stream.wait_stream(torch.cuda.current_stream())
    out = all_gather(x, group, stream)
    msg = "expected a torch.cuda.FloatTensor"
    logger.debug("step %s", x)
    return out, msg, y, z


@no_type_check
def g():
    pass


@torch.library.impl(lib, "copy_", "XPU")
def h():
    pass


@_dynamo_disable
def k():
    pass
"""


def test_classifier_names_what_cpu_cannot_observe_and_judges_the_rest():
    from conformance.mutation.classes import classify

    def at(text, operator=""):
        line = next(i for i, s in enumerate(CLASSED.splitlines(), 1) if s.strip() == text)
        return classify(CLASSED, line, operator)

    assert at("x = x.pin_memory()") == "cuda-only"  # the branch a CUDA test selects
    assert at('if device.type == "cuda":') is None  # the test itself: CPU takes the other path
    assert at("y = x + 1") is None  # eager runs this branch
    assert at("y = x * 2") == "compile/tracing"  # the else of `if not is_compiling()`
    assert at("z = x - 1") is None and at("z = x + 2") == "cuda-only"
    assert at("stream.wait_stream(torch.cuda.current_stream())") == "stream/event"
    assert at("out = all_gather(x, group, stream)") is None  # computes data: judged
    assert at('msg = "expected a torch.cuda.FloatTensor"') is None  # a string is not a path
    assert at('logger.debug("step %s", x)') == "debug/logging"
    assert at("@no_type_check", "core/RemoveDecorator") == "typing-only"
    assert at('@torch.library.impl(lib, "copy_", "XPU")', "core/RemoveDecorator") == "cuda-only"
    assert at("@_dynamo_disable", "core/RemoveDecorator") == "compile/tracing"


def test_no_caller_classes_only_private_code_nothing_names(tmp_path):
    """A private module nothing imports, and a private top-level function named only where it is
    defined, are classed; a public name, a name called elsewhere, a name a check mentions, and a
    method are judged."""
    from conformance.mutation.classes import _mentions, no_caller

    fsdp = tmp_path / "site" / "torch" / "distributed" / "fsdp"
    fsdp.mkdir(parents=True)
    (fsdp / "_orphan.py").write_text("def f():\n    return 1\n")
    (fsdp / "_utils.py").write_text(
        "def _dead():\n    return 1\n\n\n"
        "def _used():\n    return 2\n\n\n"
        "def public():\n    return 3\n\n\n"
        "def _named_by_a_check():\n    return 4\n\n\n"
        "class K:\n    def _m(self):\n        return 5\n"
    )
    (fsdp / "api.py").write_text("from ._utils import _used\n_used()\n")
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "c.py").write_text("import x\nx._named_by_a_check()\n")
    site, utils = tmp_path / "site", "torch/distributed/fsdp/_utils.py"

    def classed(file, line):
        return no_caller(site, file, line, checks=checks)

    assert classed("torch/distributed/fsdp/_orphan.py", 2)  # nothing imports the module
    assert classed(utils, 2)  # _dead: its definition is its only mention
    assert not classed(utils, 6)  # _used: api.py calls it
    assert not classed(utils, 10)  # public: a user calls it
    assert not classed(utils, 14)  # a check names it
    assert not classed(utils, 19)  # a method of a public class
    assert not classed("torch/distributed/fsdp/api.py", 2)  # module level of a public module
    _mentions.cache_clear()


def test_the_torch_overlay_loads_one_module_from_a_private_file(tmp_path):
    """[Note: the torch overlay]: with the overlay's environment, a fresh interpreter imports the
    mutant's text for that module (a package keeps its installed search path)."""
    site = population.site_root()
    file = "torch/distributed/fsdp/_fully_shard/_fsdp_api.py"
    private = tmp_path / "m.py"
    private.write_text((site / file).read_text() + "\nOVERLAID = True\n")
    env = {
        **{k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"},
        "PYTHONPATH": str(ROOT / "conformance" / "mutation" / "overlay_site"),
        "FSDP_MUTATION_OVERLAY_MODULE": population.module_of(file),
        "FSDP_MUTATION_OVERLAY_FILE": str(private),
    }
    code = (
        "import torch.distributed.fsdp as f, torch.distributed.fsdp._fully_shard._fsdp_api as m; "
        "print(m.OVERLAID, m.__file__, f.MixedPrecisionPolicy is m.MixedPrecisionPolicy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", str(private), "True"], out.stdout


def _installed_state() -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file of the torch target as installed."""
    site = population.site_root()
    state = {}
    for file in population.torch_files(site):
        path = site / file
        state[file] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return state


def test_tiny_torch_campaign_never_writes_site_packages(tmp_path):
    """Three mutants of torch's FSDPParam (seed 4), judged against torch-fsdp2 by the dim-0
    layout cases at world size 2 (on torch 2.13.0: one no case runs, two in function bodies
    judged in one shared run by a code swap, one of them killed). The installed torch files
    come out with the same contents and modification times; the verdicts and the per-group
    report exist."""
    before = _installed_state()
    cmd = [
        sys.executable,
        "-m",
        "conformance.mutation",
        "--target",
        "torch",
        "--sample",
        "3",
        "--seed",
        "4",
        "--files",
        "torch/distributed/fsdp/_fully_shard/_fsdp_param.py",
        "--checks",
        "layout and dim0",
        "--world-sizes",
        "2",
        "--fallback-world-sizes",
        "",
        "--work-dir",
        str(tmp_path / "work"),
        "--reports-dir",
        str(tmp_path),
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _installed_state() == before, "the torch campaign wrote into the installed torch"
    data = json.loads((tmp_path / "mutation.json").read_text())
    assert data["target"] == "torch" and data["sample"] == 3 and data["pending"] == 0, data
    assert data["error"] == 0 and data["judged"] == 3, data
    assert data["killed"] >= 1, data  # FSDPParam's sharding arithmetic is seen by the layout
    assert set(data["by_part"]) == {"FSDP2 init/params"}, data["by_part"]
    (session,) = (tmp_path / "work").glob("session-*.jsonl")
    records = [json.loads(line) for line in session.read_text().splitlines()]
    assert all(r["file"].startswith("torch/distributed/fsdp/") for r in records), records
    assert "live" in {r.get("run") for r in records}, records
    md = (tmp_path / "mutation.md").read_text()
    assert "# Mutation campaign (target torch)" in md and "| FSDP2 init/params |" in md


def test_triage_entries_belong_to_one_target(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        '[[gap]]\nfingerprint = "a"\nneeds = "x"\n\n'  # no target: the reference's
        '[[equivalent]]\nfingerprint = "b"\ntarget = "torch"\nreason = "y"\n'
    )
    assert set(report.load_triage(path)) == {"a"}
    assert set(report.load_triage(path, "torch")) == {"b"}
    path.write_text('[[gap]]\nfingerprint = "a"\ntarget = "tourch"\nneeds = "x"\n')
    with pytest.raises(SystemExit, match="target 'tourch' of a: expected one of reference, torch"):
        report.load_triage(path)


def test_a_mutant_in_a_decorator_wrapper_reaches_the_methods_decorated_at_import(
    tmp_path, monkeypatch
):
    """[Note: closures made before the swap]: a line inside a decorator's ``wrapper`` runs only in
    the wrappers made when another module's class was created; the swap must reach them (as for
    ``_fsdp_common._disable_functorch_if_active`` on FSDPParamGroup's methods), and undo itself."""
    import importlib

    from conformance.mutation import live

    source = (
        "import functools\n"
        "def twice(func):\n"
        "    @functools.wraps(func)\n"
        "    def wrapper(*args):\n"
        "        return 2 * func(*args)\n"
        "    return wrapper\n"
    )
    package = tmp_path / "deco_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "deco.py").write_text(source)
    (package / "user.py").write_text(
        "from deco_pkg.deco import twice\n"
        "class C:\n    @twice\n    def f(self, x):\n        return x + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    deco, user = importlib.import_module("deco_pkg.deco"), importlib.import_module("deco_pkg.user")
    mutated = source.replace("return 2 * func(*args)", "return 3 * func(*args)")
    adapter = live.MutantAdapter.__new__(live.MutantAdapter)
    adapter._plan = live.plan_swap(deco, mutated, 5)
    assert user.C().f(1) == 4
    with adapter.patched():
        assert user.C().f(1) == 6, "the wrapper made at import still runs the original"
    assert user.C().f(1) == 4
