"""The documentation: the API reference names the whole public API, and the built site renders every list.

The checks on the sources are cheap and run in the suite. ``make docs`` also runs this file as a script on the
site it has just built (``python tests/project/test_docs.py site``, standard library only, so the docs environment needs
neither torch nor pytest): the build then fails when the reference page lacks a public name, when a list was
rendered as a run-on paragraph with a literal "- " (Python-Markdown needs a blank line before a list; the
Markdown lint in ``make docs`` catches the source, this catches the result), or when a table row was rendered as
literal text (a blank line inside a table, a table with no ``| --- |`` separator under its header, or one joined to
the paragraph above it). The same table check also runs on the Markdown sources (docs/ and README.md), in the
suite and in ``make docs``, so a row that would render as text is named with its file and line.
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
# A table row that Python-Markdown left as text: a line of a <p> starting with "|" with another "|" after it.
_RUN_ON_ROW = re.compile(r"^\s*\|.*\|")
# The Markdown sources whose tables are checked, and the parts of a table.
MARKDOWN_SOURCES = (ROOT / "docs", ROOT / "README.md")
_TABLE_LINE = re.compile(r"^(\s*)\|")
_SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


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
            problems += [f"{built}: a table row rendered as text: {line.strip()[:100]!r}"
                         for line in paragraph.split("\n") if _RUN_ON_ROW.match(line)]
    return problems


def _markdown_files(sources: tuple[Path, ...]) -> list[Path]:
    return [file for source in sources for file in ([source] if source.is_file() else sorted(source.rglob("*.md")))]


def table_problems(text: str, name: str) -> list[str]:
    """Every table row in a Markdown text that would render as literal text, named by ``name:line``.

    Lines inside fenced code blocks are skipped. A run of lines starting with ``|`` (at one indentation) is a
    table only when its first line is the header, its second a ``| --- |`` separator, and the line above it is
    blank or a heading: Python-Markdown renders anything else, a row after a blank line inside a table included,
    as a paragraph of text.
    """
    problems = []
    lines = text.split("\n")
    fence = None
    start = None  # the first line of the current run of table lines
    for number, line in enumerate([*lines, ""], start=1):
        opened = _FENCE.match(line)
        if fence is not None:
            fence = None if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) else fence
            continue
        row = _TABLE_LINE.match(line)
        if start is not None and (not row or row.group(1) != _TABLE_LINE.match(lines[start - 1]).group(1)):
            run = lines[start - 1:number - 1]
            above = lines[start - 2].strip() if start > 1 else ""
            where = f"{name}:{start}"
            if len(run) < 2 or not _SEPARATOR.match(run[1]):
                problems.append(f"{where}: a table row with no header and '| --- |' separator above it "
                                f"(a blank line inside a table?), rendered as text: {run[0].strip()[:80]!r}")
            elif above and not above.startswith("#"):
                problems.append(f"{where}: a table joined to the line above it (a blank line is needed before a "
                                f"table), rendered as text: {run[0].strip()[:80]!r}")
            start = None
        if opened:
            fence = opened.group(1)
        elif row and start is None:
            start = number
    return problems


def source_problems(sources: tuple[Path, ...] = MARKDOWN_SOURCES) -> list[str]:
    """The table rows in the Markdown sources (docs/ and README.md) that would render as literal text."""
    return [problem for file in _markdown_files(sources)
            for problem in table_problems(file.read_text(), str(file.relative_to(ROOT) if file.is_relative_to(ROOT)
                                                                  else file))]


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


def _keyword_parameters(module: Path, function: str) -> list[str]:
    """The keyword-only parameters of a function, read from its module's source (nothing is imported)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [argument.arg for argument in node.args.kwonlyargs]
    raise AssertionError(f"{module} has no function {function}")


def test_the_configuration_page_lists_every_configure_checkpointing_argument() -> None:
    """docs/configuration.md's signature of configure_checkpointing and its options table name every keyword the
    code takes (``signing_key`` and ``verification_keys`` were once left to the docstring), in the code's order."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    code = _keyword_parameters(PACKAGE / "accelerate" / "config.py", "configure_checkpointing")
    signature = re.search(r"^accelerate_txn\.configure_checkpointing\(\n    accelerator,\n(.*?)^\)", text,
                          re.MULTILINE | re.DOTALL)
    assert signature, "docs/configuration.md: no configure_checkpointing(accelerator, ...) signature block"
    listed = re.findall(r"^    (\w+)=None,$", signature.group(1), re.MULTILINE)
    assert listed == code, f"docs/configuration.md's signature names {listed}; the code takes {code}"
    section = text.split("## `configure_checkpointing`", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert sorted(rows) == sorted(code), (f"options table: missing {sorted(set(code) - set(rows))}, "
                                          f"not arguments {sorted(set(rows) - set(code))}")


def test_the_reference_page_is_in_the_navigation() -> None:
    assert re.search(r"^\s+- API reference: reference/api\.md$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)


def test_expected_anchors_cover_the_public_api() -> None:
    anchors = expected_anchors()
    assert "accelerate_txn.configure_checkpointing" in anchors
    assert "accelerate_txn.errors.CheckpointError" in anchors
    assert "accelerate_txn.weights.export_dcp_to_diffusers" in anchors
    assert {"accelerate_txn.testing.launch", "accelerate_txn.testing.fsdp_accelerator"} <= set(anchors)
    assert len(anchors) == len(set(anchors))


_TABLE = "| option | meaning |\n| --- | :---: |\n| `-n N` | ranks |\n"


def test_every_table_in_the_docs_and_readme_renders_as_a_table() -> None:
    assert source_problems() == []


def test_the_table_check_passes_proper_tables() -> None:
    indented = _TABLE.replace("\n", "\n    ")
    text = (f"# Title\n\n{_TABLE}\nText.\n\n### Heading\n{_TABLE}\n- a list item:\n\n    {indented}"
            "\n```bash\n| not a table, in a fence\n```\n\n~~~\n```\n| still fenced\n~~~\n")
    assert table_problems(text, "page.md") == []


def test_the_table_check_finds_a_row_split_off_by_a_blank_line() -> None:
    problems = table_problems(f"Intro.\n\n{_TABLE}\n| `--tp-size N` | the size |\n\nAfter.\n", "page.md")
    assert problems == ["page.md:7: a table row with no header and '| --- |' separator above it (a blank line "
                        "inside a table?), rendered as text: '| `--tp-size N` | the size |'"], problems


def test_the_table_check_finds_a_table_without_a_separator_or_joined_to_a_paragraph() -> None:
    no_separator = table_problems("| option | meaning |\n| `-n N` | ranks |\n", "a.md")
    assert len(no_separator) == 1 and no_separator[0].startswith("a.md:1: a table row with no header"), no_separator
    joined = table_problems(f"The options:\n{_TABLE}", "b.md")
    assert joined == ["b.md:2: a table joined to the line above it (a blank line is needed before a table), "
                      "rendered as text: '| option | meaning |'"], joined


def test_the_source_check_reads_the_docs_tree_and_a_single_file(tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "sub" / "page.md").write_text(f"{_TABLE}\n| orphan | row |\n")
    (tmp_path / "docs" / "good.md").write_text(_TABLE)
    (tmp_path / "README.md").write_text(f"Text\n{_TABLE}")
    problems = source_problems((tmp_path / "docs", tmp_path / "README.md"))
    assert [problem.split(": ")[0] for problem in problems] == [f"{tmp_path / 'docs' / 'sub' / 'page.md'}:5",
                                                                 f"{tmp_path / 'README.md'}:2"], problems


def _site(tmp_path: Path, reference: str, other: str) -> Path:
    (tmp_path / REFERENCE_PAGE).parent.mkdir(parents=True)
    (tmp_path / REFERENCE_PAGE).write_text(reference)
    (tmp_path / "usage.html").write_text(other)
    return tmp_path


def test_the_site_check_passes_a_complete_reference_and_proper_lists(tmp_path: Path) -> None:
    reference = "".join(f'<h3 id="{anchor}">x</h3>' for anchor in expected_anchors())
    site = _site(tmp_path, reference, "<p>Before:</p>\n<ul>\n<li>an item</li>\n</ul>\n<p>a - b, 1. c</p>\n"
                                      "<table>\n<tr><td>a</td></tr>\n</table>\n<p>a | b, a shell pipe, then |x</p>")
    assert site_problems(site) == []


def test_the_site_check_finds_a_table_row_rendered_as_text(tmp_path: Path) -> None:
    reference = "".join(f'<h3 id="{anchor}">x</h3>' for anchor in expected_anchors())
    site = _site(tmp_path, reference, "<table>\n<tr><td>a</td></tr>\n</table>\n"
                                      "<p>| <code>--tp-size N</code> | none | the size |</p>\n"
                                      "<p>Options:\n| a | b |\n| --- | --- |</p>")
    problems = site_problems(site)
    assert problems == [f"{tmp_path / 'usage.html'}: a table row rendered as text: "
                        "'| <code>--tp-size N</code> | none | the size |'",
                        f"{tmp_path / 'usage.html'}: a table row rendered as text: '| a | b |'",
                        f"{tmp_path / 'usage.html'}: a table row rendered as text: '| --- | --- |'"], problems


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
    found = source_problems() + site_problems(Path(sys.argv[1]))
    print("\n".join(found) or f"{sys.argv[1]}: the API reference names all {len(expected_anchors())} public names; "
          "every list renders as a list, every table as a table")
    sys.exit(1 if found else 0)
