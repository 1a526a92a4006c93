"""README.md is a map of at most 180 lines, docs/ references of at most 3,000 in all, and every relative link
in them resolves."""

import importlib
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
#: The README's sections, in the order a reader meets them.
README_SECTIONS = ["Install", "The two commands", "The one-line swap", "`tune-offload`", "Which optimizer when",
                   "One GPU result", "OffloadOptimizer in your own loop", "Limitations", "Docs"]
# [text](target) and ![alt](target), not inside code spans; the target up to a space or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code(text: str) -> str:
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> Set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: Dict[str, int] = {}
    out = set()
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def _relative_links(page: Path) -> List[str]:
    return [t for t in _LINK.findall(_without_code(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours to check


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_link_check_sees_links_and_anchors(tmp_path):
    (tmp_path / "a.md").write_text("# Top: the `x` part\n\n[b](b.md#two-words) ![i](img.png) `[no](c.md)`\n")
    (tmp_path / "b.md").write_text("## Two words\n")
    assert _relative_links(tmp_path / "a.md") == ["b.md#two-words", "img.png"]
    assert _anchors(tmp_path / "a.md") == {"top-the-x-part"}
    assert _anchors(tmp_path / "b.md") == {"two-words"}


README_MAX_LINES, DOCS_MAX_LINES = 180, 3000
#: Words of a page that reads as a lab notebook rather than a reference.
NOTEBOOK = re.compile(r"\b(we (first )?tried|still to run|not measured yet|next we|TODO)\b", re.IGNORECASE)


def test_the_docs_are_references_of_bounded_length():
    pages = sorted((REPO / "docs").glob("*.md"))
    lines = {p.name: len(p.read_text().splitlines()) for p in pages}
    assert sum(lines.values()) <= DOCS_MAX_LINES, lines
    notebook = [f"{p.name}: {m.group(0)}" for p in pages for m in NOTEBOOK.finditer(p.read_text())]
    assert not notebook, notebook


def test_readme_is_a_map():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    sections = re.findall(r"^## (.*)$", text, flags=re.M)
    assert [s for s in sections if s in README_SECTIONS] == README_SECTIONS, sections
    # Status belongs to docs/: no commit hashes and no lists of what is still to run.
    assert not re.search(r"`[0-9a-f]{7,40}`", text)
    assert "still to run" not in text.lower()


def _architecture_names():
    text = (REPO / "docs" / "architecture.md").read_text()
    return re.findall(r"`([^`\s]+)`", text)


def test_every_module_class_and_path_the_architecture_page_names_exists():
    names = _architecture_names()
    classes = {}
    missing = []
    for name in names:
        if name.startswith("torchtune_offload.") and "/" not in name:
            parts = name.split(".")
            # The longest importable module prefix, then attributes.
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ModuleNotFoundError:
                    continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
                continue
            if isinstance(obj, type):
                classes[obj.__name__] = obj
        elif "/" in name and not name.startswith("optimizer."):
            if not (REPO / name).exists():
                missing.append(name)
    for name in names:
        head, _, method = name.partition(".")
        if method and "/" not in name and head in classes:
            if not hasattr(classes[head], method.split("(")[0]):
                missing.append(name)
    assert len(classes) >= 10, "the page names the collaborators by their dotted paths"
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_layout_page_names_every_file_of_the_package():
    """docs/layout.md reads as the package's file map: a module added without a line there fails here."""
    text = (REPO / "docs" / "layout.md").read_text()
    # Each folder's files are named in that folder's bullet ("- `torchtune_offload/optim/`: ..."),
    # so a module named only under another folder (a second memory.py, say) is missing.
    bullets = re.split(r"\n- ", text)
    named = {m.group(1): set(re.findall(r"`([\w.]+)`", bullet)) for bullet in bullets
             for m in [re.match(r"`torchtune_offload/(\w+)/`", bullet)] if m}
    package = REPO / "torchtune_offload"
    files = [p for p in package.rglob("*") if p.is_file() and p.suffix in (".py", ".c", ".h", ".json")
             and p.name != "__init__.py" and "__pycache__" not in p.parts and "_shipped" not in p.parts]
    assert files and len(named) >= 9
    missing = sorted(str(p.relative_to(package)) for p in files
                     if p.name not in named.get(p.relative_to(package).parts[0], set()))
    assert not missing, f"docs/layout.md does not name these in their folder's line: {missing}"
