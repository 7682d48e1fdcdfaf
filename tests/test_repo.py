"""The repository stands on its own: no file points a reader at the design folder beside it, which lies outside it
(a reader would meet a dead source). An external figure is copied into research/chNN/sources.md with its
original source, and cited from there."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a path into the outside folder (its name then a slash, "../" then its name) or its facts file; not the
# word "shared" ("pages shared by a fork", "shared_prefix", "unshared" with a slash). The samples below are built
# from FOLDER so that this file does not itself read as such a path.
FOLDER = "shared"
SHARED = re.compile(rf"(?<![\w-])(?:\.\./)*{FOLDER}/|\.\./{FOLDER}\b|\bFACTS\.md\b")


def repository_files() -> list[Path]:
    """Every file git tracks, plus new files it does not ignore (they are about to be committed)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    names = sorted({n for n in out.split("\0") if n and not n.startswith(f"{FOLDER}/")})
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def references_to_shared(files) -> list[str]:
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a PNG, a binary: no prose
            continue
        lines = text.splitlines()
        for line in sorted({text.count("\n", 0, m.start()) + 1 for m in SHARED.finditer(text)}):
            found.append(f"{path.relative_to(ROOT)}:{line}: {lines[line - 1].strip()[:120]}")
    return found


def test_no_file_refers_to_the_shared_folder():
    files = [f for f in repository_files() if f.resolve() != Path(__file__).resolve()]
    assert files, "git lists no files"
    found = references_to_shared(files)
    assert found == [], (f"files point at {FOLDER}/, which is not part of the repository; copy the figure into "
                         "research/chNN/sources.md with its original source and cite that:\n  " + "\n  ".join(found))


@pytest.mark.parametrize("text, hits", [
    (f"see {FOLDER}/FACTS.md", 2),
    (f"from ../{FOLDER}", 1),
    (f"(/work/{FOLDER}/DESIGN.md)", 1),
    (f"`{FOLDER}/`", 1),
    (f"pages shared by a fork; the shared_prefix; un{FOLDER}/ ; shared-prefix/ ; overshared", 0),
])
def test_the_pattern_finds_paths_not_words(text, hits):
    assert len(SHARED.findall(text)) == hits
