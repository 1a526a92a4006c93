"""What the repository holds: a short top level of ``scripts/`` (what a user runs; the benchmarks whose
figures the docs state in ``scripts/bench/``), each script naming its own path in its usage, and words
that speak of the project alone, never of how its work was organised."""

import re
import subprocess
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Files directly in scripts/, at most; ``scripts/bench/`` holds the benchmarks.
MAX_TOP_LEVEL_SCRIPTS = 18

#: Words about how the work was organised rather than about the project. Name a machine by its CPU or
#: GPU and a measurement by its date and commit instead.
ORGANISATION_WORDS = re.compile(r"\bsession|\blease|\bowed\b|issue [0-9]+", re.IGNORECASE)

#: Genuine uses of those words, removed from a line before it is searched: pytest's widest fixture
#: scope and the request's view of the whole test run, and an HTTP client.
GENUINE_USES = ('scope="session"', "request.session", "requests.Session")


def _tracked_files() -> List[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def _scripts() -> List[Path]:
    return sorted(p for p in (REPO / "scripts").rglob("*") if p.is_file() and p.suffix in (".py", ".sh"))


def test_scripts_keeps_a_short_top_level():
    files = sorted(p.name for p in (REPO / "scripts").iterdir() if p.is_file() and not p.name.startswith("."))
    assert len(files) <= MAX_TOP_LEVEL_SCRIPTS, (
        f"scripts/ holds {len(files)} files, more than {MAX_TOP_LEVEL_SCRIPTS}: put a benchmark in scripts/bench/ "
        f"and retire a one-off measurement whose result the docs record: {files}")


def test_every_script_names_its_own_path_in_its_usage():
    """A moved script's usage moves with it: each runs from the repository root as it says."""
    wrong = []
    for path in _scripts():
        name = path.relative_to(REPO).as_posix()
        runner = "bash" if path.suffix == ".sh" else "python"
        if not re.search(rf"{runner} {re.escape(name)}\b", path.read_text()):
            wrong.append(name)
    assert _scripts() and not wrong, f"no '<python or bash> <its path>' usage line in: {wrong}"


def test_the_repository_speaks_of_the_project_only():
    hits = []
    for path in _tracked_files():
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for use in GENUINE_USES:
                line = line.replace(use, "")
            match = ORGANISATION_WORDS.search(line)
            if match:
                hits.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    assert not hits, ("name a machine by its CPU or GPU and a measurement by its date and commit, not by how the "
                      f"work was organised ({len(hits)} lines):\n" + "\n".join(hits[:60]))


def test_the_word_check_sees_the_words_and_passes_genuine_uses():
    # Each word split in two, so that this file passes the check above.
    for line in ("the third Ses" "sion of a day", "on a le" "ase of the machine", "the checks still ow" "ed",
                 "see iss" "ue 43"):
        assert ORGANISATION_WORDS.search(line), line
    for line in ("a narrowed model", "released memory", "the allowed keys", "an issue with a number",
                 '@pytest.fixture(scope="session")', "request.session.items", "requests.Session()"):
        for use in GENUINE_USES:
            line = line.replace(use, "")
        assert not ORGANISATION_WORDS.search(line), line
