"""conformance/SPEC.md defines every behaviour id the checks cite, says for each id which checks
cover it or why none can, and its generated id -> checks table is up to date."""

from conformance import spec


def test_spec_and_checks_agree():
    found = spec.problems(spec.SPEC_MD.read_text(), spec.coverage())
    assert not found, "\n".join(found)


def test_citations_are_read_from_docstrings():
    assert spec.cited_ids("A rule (X1, P12); S2-S4: more; W16 (seed era)") == {
        "X1",
        "P12",
        "S2",
        "S3",
        "S4",
        "W16",
    }
    assert spec.cited_ids("no ids in ws4 or w1 or SP3") == set()


def test_each_kind_of_disagreement_is_reported():
    text = (
        "- **P1** a rule\n- **P2** another. *No check:* GPU only\n- **P3** nobody checks it\n"
        f"{spec.BEGIN}\nold table\n{spec.END}\n"
    )
    found = spec.problems(text, {"P1": ["layout::a"], "P9": ["states::b"]})
    assert any(f.startswith("P9 is cited by states::b") for f in found), found
    assert any(f.startswith("P3 has no check") for f in found), found
    assert not any(f.startswith(("P1 ", "P2 ")) for f in found), found
    found = spec.problems(text, {"P1": ["layout::a"], "P2": ["states::c"]})
    assert any(f.startswith("P2 is checked by states::c but SPEC.md still says") for f in found)
    assert any("stale" in f for f in found), found
    text = text.replace("- **P3** nobody checks it\n", "")
    fresh = text.replace(
        f"{spec.BEGIN}\nold table\n{spec.END}",
        spec.render(spec.definitions(text), {"P1": ["layout::a"]}),
    )
    assert spec.problems(fresh, {"P1": ["layout::a"]}) == []
