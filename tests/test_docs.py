"""README.md stays true to the schema and the commands."""

from __future__ import annotations

from pipeline import docs
from tests.conftest import REPO


def test_the_readme_reference_matches_the_schema():
    text = (REPO / "README.md").read_text()
    section = text.split(docs.START, 1)[1].split(docs.END, 1)[0].strip()
    assert section == docs.reference_markdown().strip(), "README reference is stale: run `make docs`"


def test_the_readme_starts_with_make_pipeline_then_make_test():
    text = (REPO / "README.md").read_text()
    first = text.index("make pipeline")
    assert first < text.index("make test") < text.index("## Commands")
