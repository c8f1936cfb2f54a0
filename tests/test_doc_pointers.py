"""Pointers into the documentation stay true: every `docs/<name>.md` named anywhere in the tree
exists, and every section it names (`docs/parallel.md, "Context parallelism"`, `docs/training.md#
stopping-and-exit-statuses`, `README, "First run on a GPU"`) is a heading of that file. And the
other way: every path of the checkout the README and docs/ name (a code span such as
`training/run/store.py` or `scripts/bench/`, a relative link) exists, so docs/architecture.md's
map of the code cannot go stale.

A section named after README without quotes (`README, Multi-GPU`) is checked too: that is how the
pointers read before the README's long sections moved into docs/, and such a pointer goes stale
without anyone noticing. The checker is a plain function so a planted tree can watch it fail.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["configs", "model", "kernels", "data", "training", "tests", "scripts", "docs", "benchmarks"]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".sh", ".txt"}

# A documentation file (the README of the root or of benchmarks/, or one under docs/), then either
# an anchor, a quoted heading, or (README only) an unquoted capitalised section name.
POINTER = re.compile(
    r"(?P<file>(?:benchmarks/)?README(?:\.md)?(?:'s)?|docs/[\w-]+\.md)"
    r"(?:#(?P<anchor>[\w-]+)|,? (?P<q>[\"'])(?P<quoted>[^\"'\n]+)(?P=q)|,? (?P<bare>[A-Z][\w-]*(?: [\w-]+)*))?")


def _headings(path: Path) -> list[str]:
    """The file's Markdown headings, code blocks left out (a `# comment` in a shell example is none)."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} +(.+?) *#*$", line)):
            found.append(m.group(1).replace("`", ""))
    return found


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _files(root: Path) -> list[Path]:
    files = [root / name for name in ("README.md", "train.py", "pyproject.toml") if (root / name).exists()]
    for part in PARTS:
        if (root / part).is_dir():
            files += sorted(p for p in (root / part).rglob("*") if p.suffix in SUFFIXES and p.is_file()
                            and "__pycache__" not in p.parts)
    return [p for p in files if p.resolve() != Path(__file__).resolve()]   # this file's own examples


def check_pointers(root: Path) -> list[str]:
    """One line per pointer to a documentation file or section that does not exist."""
    problems: list[str] = []
    for path in _files(root):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in POINTER.finditer(line):
                name = m.group("file").removesuffix("'s")
                target = root / (name if name.endswith(".md") else f"{name}.md")
                where = f"{path.relative_to(root)}:{number}"
                if not target.is_file():
                    problems.append(f"{where}: {name} does not exist")
                    continue
                headings = [h.lower() for h in _headings(target)]
                if m.group("anchor") and m.group("anchor").lower() not in {_slug(h) for h in headings}:
                    problems.append(f"{where}: {target.relative_to(root)} has no heading #{m.group('anchor')}")
                elif m.group("quoted") and not any(h.startswith(m.group("quoted").lower()) for h in headings):
                    problems.append(f"{where}: {target.relative_to(root)} has no heading \"{m.group('quoted')}\"")
                elif (m.group("bare") and "README" in name
                      and not any(m.group("bare").lower().startswith(h) for h in headings)):
                    problems.append(f"{where}: {target.relative_to(root)} has no section {m.group('bare')!r}")
    return problems


def test_every_pointer_into_the_docs_names_a_file_and_heading_that_exist():
    assert check_pointers(ROOT) == []


# A path of the checkout in a code span: under one of its parts (a file or a folder), or train.py.
CODE_PATH = re.compile(r"`((?:" + "|".join(PARTS) + r")/[\w./-]*|train\.py)`")
LINK = re.compile(r"\]\(([^)#\s:]+)(?:#[\w-]*)?\)")   # a relative Markdown link (no scheme), anchor aside
ELSEWHERE = {"data/tinyshakespeare/input.txt"}   # named as karpathy/char-rnn's file, not ours


def check_paths(root: Path) -> list[str]:
    """One line per path of the checkout that the README or a page of docs/ names and that does not exist."""
    problems = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not doc.is_file():
            continue
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            named = [(m.group(1), root / m.group(1)) for m in CODE_PATH.finditer(line) if m.group(1) not in ELSEWHERE]
            named += [(m.group(1), doc.parent / m.group(1)) for m in LINK.finditer(line)]
            problems += [f"{doc.relative_to(root)}:{number}: {name} does not exist" for name, path in named
                         if not path.exists()]
    return problems


def test_every_path_the_docs_name_exists():
    assert check_paths(ROOT) == []


def test_a_stale_path_is_found(tmp_path):
    for rel in ("docs/architecture.md", "training/run/store.py", "scripts/bench/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "training/run/store.py").write_text("")
    (tmp_path / "docs/architecture.md").write_text(
        "The store: `training/run/store.py`, the tools `scripts/bench/`, [the store](../training/run/store.py).\n"
        "Gone: `training/checkpoint.py`, `scripts/kernel_dev/`, [old](../training/resume.py#x), `kernels.flash_op`.\n")
    assert check_paths(tmp_path) == ["docs/architecture.md:2: training/checkpoint.py does not exist",
                                     "docs/architecture.md:2: scripts/kernel_dev/ does not exist",
                                     "docs/architecture.md:2: ../training/resume.py does not exist"]


def test_stale_pointers_are_found(tmp_path):
    """A planted tree: good pointers of each form pass, each kind of stale one is one line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "parallel.md").write_text("# Several GPUs\n\n```bash\n# not a heading\n```\n"
                                                  "## Context parallelism\n")
    (tmp_path / "README.md").write_text("# flashtrain\n\n## First run on a GPU: shakespeare-char\n")
    (tmp_path / "train.py").write_text(
        '"""Good: docs/parallel.md, "Context parallelism"; docs/parallel.md#several-gpus;\n'
        'README, "First run on a GPU"; README.md; the README\'s first example.\n'
        "Stale: docs/gone.md; docs/parallel.md, 'Multi-GPU'; docs/parallel.md#not-a-heading;\n"
        'README, Multi-GPU; README "Resume"\n"""\n')
    assert check_pointers(tmp_path) == [
        "train.py:3: docs/gone.md does not exist",
        "train.py:3: docs/parallel.md has no heading \"Multi-GPU\"",
        "train.py:3: docs/parallel.md has no heading #not-a-heading",
        "train.py:4: README.md has no section 'Multi-GPU'",
        "train.py:4: README.md has no heading \"Resume\"",
    ]
