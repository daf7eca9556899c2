"""``python -m conformance list-checks`` (conformance/listing.py): every built-in check once, at the
file and line that define it, with the SPEC ids it cites; and the README's map names every part."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance import listing, spec
from conformance.__main__ import SUBCOMMANDS
from conformance.registry import CHECKS

ROOT = Path(__file__).resolve().parents[2]
CHECKS_DIR = ROOT / "conformance" / "checks"


@pytest.fixture(scope="module")
def rows():
    return listing.rows()


def test_every_check_once_at_its_definition(rows):
    ids = [r.id for r in rows]
    assert len(ids) == len(set(ids)), "a check is listed twice"
    assert set(ids) == {f"{c.area}::{c.name}" for c in CHECKS}
    for row in rows:
        path = ROOT / row.file
        parts = Path(row.file).parts
        assert path.is_file() and parts[:2] == ("conformance", "checks"), row
        # a check module sits in a part's package and is not a helper module
        assert len(parts) >= 4 and not any(p.startswith("_") for p in parts[2:]), row
        lines = path.read_text().splitlines()
        assert lines[row.line - 1].startswith(("@", "def ")), (row, lines[row.line - 1])
        # from the given line (the first decorator) the first def is the check's own
        first_def = next(line for line in lines[row.line - 1 :] if line.startswith("def "))
        assert first_def.startswith(f"def {row.id.split('::')[1]}("), (row, first_def)


def test_cites_are_what_spec_coverage_says(rows):
    by_id = {}
    for row in rows:
        for bid in row.cites:
            by_id.setdefault(bid, set()).add(row.id)
    assert by_id == {bid: set(names) for bid, names in spec.coverage().items()}
    defined = list(spec.definitions(spec.SPEC_MD.read_text()))
    order = {bid: i for i, bid in enumerate(defined)}
    for (
        row
    ) in rows:  # in the order SPEC.md defines the ids (an undefined one last: test_spec's job)
        assert list(row.cites) == sorted(row.cites, key=lambda b: (order.get(b, len(order)), b))


def test_cli_filters_and_formats(rows, capsys, monkeypatch):
    monkeypatch.setattr(listing, "rows", lambda: rows)
    assert listing.main(["--cites", "S5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["id", "file", "cites"]
    listed = {line.split()[0] for line in out[1:-1]}
    assert listed == set(spec.coverage()["S5"])
    files = {line.split()[1].rpartition(":")[0] for line in out[1:-1]}
    assert out[-1] == f"{len(listed)} checks in {len(files)} files"

    target = next(r for r in rows if r.cites)
    assert listing.main([target.id, "--tsv"]) == 0
    tsv = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [target.id, f"{target.file}:{target.line}", " ".join(target.cites)] in tsv
    assert all(target.id in cells[0] or target.id in cells[1] for cells in tsv)

    part = "conformance/checks/wrap/"
    assert listing.main([part, "--tsv"]) == 0
    where = {line.split("\t")[1] for line in capsys.readouterr().out.splitlines()}
    assert where and where == {f"{r.file}:{r.line}" for r in rows if r.file.startswith(part)}

    assert listing.main(["no-such-check"]) == 1
    assert "no check matches" in capsys.readouterr().err


def test_unknown_spec_id_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as exc:
        listing.main(["--cites", "Q9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cites Q9" in err and "SPEC.md defines no such id" in err


def test_registered_as_a_subcommand():
    module, _, function = SUBCOMMANDS["list-checks"].partition(":")
    assert (module, function) == ("conformance.listing", "main")


def test_readme_map_names_every_part_package():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Where the checks live", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_0-9]+)/` \|", section, re.M))
    packages = {p.name for p in CHECKS_DIR.iterdir() if (p / "__init__.py").is_file()}
    assert named == packages, f"README map names {sorted(named)}, packages are {sorted(packages)}"
