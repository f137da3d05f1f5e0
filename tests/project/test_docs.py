"""The documentation: the API reference names the whole public API, and the built site renders every list.

The checks on the sources are cheap and run in the suite. ``make docs`` also runs this file as a script on the
site it has just built (``python tests/project/test_docs.py site``, standard library only, so the docs environment needs
neither torch nor pytest): the build then fails when the reference page lacks a public name, or when a list was
rendered as a run-on paragraph with a literal "- " (Python-Markdown needs a blank line before a list; the
Markdown lint in ``make docs`` catches the source, this catches the result).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "accelerate_txn"
REFERENCE = ROOT / "docs" / "reference" / "api.md"
REFERENCE_PAGE = Path("reference") / "api" / "index.html"  # where mkdocs builds REFERENCE, inside the site

# A list item that Python-Markdown left inside a paragraph: a line of a <p> starting with a list marker.
_RUN_ON_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
_PARAGRAPH = re.compile(r"<p(?:\s[^>]*)?>(.*?)</p>", re.DOTALL)


def _all_of(module: Path) -> list[str]:
    """``__all__`` of a module, read from its source (nothing is imported)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    raise AssertionError(f"{module} has no __all__")


def expected_anchors() -> list[str]:
    """Every public name, as the identifier the reference page gives it (its HTML anchor)."""
    errors = set(_all_of(PACKAGE / "errors.py"))
    anchors = [f"accelerate_txn.errors.{name}" if name in errors else f"accelerate_txn.{name}"
               for name in _all_of(PACKAGE / "__init__.py")]
    anchors += [f"accelerate_txn.weights.{name}" for name in _all_of(PACKAGE / "weights" / "__init__.py")]
    anchors += [f"accelerate_txn.testing.{name}" for name in _all_of(PACKAGE / "testing" / "__init__.py")]
    return anchors


def site_problems(site: Path) -> list[str]:
    """What is wrong with a built site: a public name missing from the reference page, a list rendered as text."""
    problems = []
    page = site / REFERENCE_PAGE
    if not page.is_file():
        problems.append(f"{page}: the API reference page was not built")
    else:
        html = page.read_text()
        problems += [f"{page}: no entry for {anchor}" for anchor in expected_anchors() if f'id="{anchor}"' not in html]
    for built in sorted(site.rglob("*.html")):
        for paragraph in _PARAGRAPH.findall(built.read_text()):
            problems += [f"{built}: a list item rendered inside a paragraph: {line.strip()[:100]!r}"
                         for line in paragraph.split("\n")[1:] if _RUN_ON_ITEM.match(line)]
    return problems


def test_the_reference_page_names_every_public_export() -> None:
    text = REFERENCE.read_text()
    directives = set(re.findall(r"^::: (accelerate_txn(?:\.\w+)*)\s*$", text, re.MULTILINE))
    members = set(re.findall(r"^\s+- (\w+)\s*$", text, re.MULTILINE))  # an explicit members list
    errors = set(_all_of(PACKAGE / "errors.py"))
    missing = [name for name in _all_of(PACKAGE / "__init__.py")
               if f"accelerate_txn.{name}" not in directives
               and not (name in errors and "accelerate_txn.errors" in directives and name in members)]
    assert not missing, f"docs/reference/api.md does not document {missing}"
    assert errors <= members, f"accelerate_txn.errors members left out: {sorted(errors - members)}"
    assert {"accelerate_txn.errors", "accelerate_txn.weights", "accelerate_txn.testing"} <= directives


def test_the_reference_page_is_in_the_navigation() -> None:
    assert re.search(r"^\s+- API reference: reference/api\.md$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)


def test_expected_anchors_cover_the_public_api() -> None:
    anchors = expected_anchors()
    assert "accelerate_txn.configure_checkpointing" in anchors
    assert "accelerate_txn.errors.CheckpointError" in anchors
    assert "accelerate_txn.weights.export_dcp_to_diffusers" in anchors
    assert {"accelerate_txn.testing.launch", "accelerate_txn.testing.fsdp_accelerator"} <= set(anchors)
    assert len(anchors) == len(set(anchors))


def _site(tmp_path: Path, reference: str, other: str) -> Path:
    (tmp_path / REFERENCE_PAGE).parent.mkdir(parents=True)
    (tmp_path / REFERENCE_PAGE).write_text(reference)
    (tmp_path / "usage.html").write_text(other)
    return tmp_path


def test_the_site_check_passes_a_complete_reference_and_proper_lists(tmp_path: Path) -> None:
    reference = "".join(f'<h3 id="{anchor}">x</h3>' for anchor in expected_anchors())
    site = _site(tmp_path, reference, "<p>Before:</p>\n<ul>\n<li>an item</li>\n</ul>\n<p>a - b, 1. c</p>")
    assert site_problems(site) == []


def test_the_site_check_finds_a_list_rendered_as_a_paragraph(tmp_path: Path) -> None:
    reference = "".join(f'<h3 id="{anchor}">x</h3>' for anchor in expected_anchors())
    site = _site(tmp_path, reference, "<p><strong>Reading it.</strong>\n- Memory. one\n- Time. two</p>\n"
                                      "<p>Publish order\n1. Every rank</p>")
    problems = site_problems(site)
    assert len(problems) == 3, problems
    assert "a list item rendered inside a paragraph: '- Memory. one'" in problems[0]
    assert "'1. Every rank'" in problems[2]


def test_the_site_check_finds_a_public_name_missing_from_the_reference(tmp_path: Path) -> None:
    anchors = expected_anchors()
    reference = "".join(f'<h3 id="{anchor}">x</h3>' for anchor in anchors if anchor != "accelerate_txn.testing.launch")
    assert site_problems(_site(tmp_path, reference, "")) == [
        f"{tmp_path / REFERENCE_PAGE}: no entry for accelerate_txn.testing.launch"]
    (tmp_path / REFERENCE_PAGE).unlink()
    assert site_problems(tmp_path) == [f"{tmp_path / REFERENCE_PAGE}: the API reference page was not built"]


if __name__ == "__main__":  # make docs: python tests/project/test_docs.py SITE_DIR
    found = site_problems(Path(sys.argv[1]))
    print("\n".join(found) or f"{sys.argv[1]}: the API reference names all {len(expected_anchors())} public names; "
          "every list renders as a list")
    sys.exit(1 if found else 0)
