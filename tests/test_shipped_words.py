"""Shipped files speak of the product only.

- No file `git ls-files` lists refers to the project's own issue tracker by number: an issue number means nothing to
  a user.
- The package (trl_gspo/) and the README carry no dated figures: no dates, machine names or commit ids in code,
  comments, docstrings, help strings or error messages. A measurement lives in docs/results.md (or the docs page
  that holds it) with its machine, date and command; the code states the rule and links that section.

A hit fails the test with file:line for each one. Reword the text; where an ordinary use cannot be reworded, add a
narrow ALLOWED entry naming the file and the phrase."""

import re
import subprocess
from pathlib import Path

from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# name -> pattern, matched case-insensitively on each line of every shipped file.
EVERYWHERE = {
    "issue number": r"\bissues?\s*#?\d+\b",
}
# name -> pattern, matched on each line of the package and the README (figures and their provenance: docs/results.md).
DATED = {
    "date": r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.? 20\d\d\b",
    "machine": r"\b(?:[abh]100|[gh]h?200|b200|mi[23]\d\dx?|epyc|xeon|ryzen|graviton|firecracker)\b|\b\d+-core\b"
               r"|\bvcpus?\b|\bx86_64 vm\b",
    "commit id": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
}
DATED_PLACES = ("trl_gspo/", "README.md")

# A link into the docs names the section that holds a measurement ("docs/results.md#on-one-h100"): not a figure.
DOCS_LINK = re.compile(r"\bdocs/[\w./-]+#[\w-]+")

# (file, phrase): a hit inside this phrase in this file is allowed.
ALLOWED: list[tuple[str, str]] = []


def _compile(patterns):
    return {name: re.compile(pattern, re.IGNORECASE) for name, pattern in patterns.items()}


PATTERNS, DATED_PATTERNS = _compile(EVERYWHERE), _compile(DATED)


def _shipped_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, env=cpu_env()).stdout
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or name == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        try:
            yield name, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def _hits(name, text):
    patterns = dict(PATTERNS)
    if name.startswith(DATED_PLACES):
        patterns.update(DATED_PATTERNS)
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [m.span() for file, phrase in ALLOWED if file == name
                   for m in re.finditer(re.escape(phrase), line)]
        allowed += [m.span() for m in DOCS_LINK.finditer(line)]
        for word, pattern in patterns.items():
            for match in pattern.finditer(line):
                if any(start <= match.start() and match.end() <= end for start, end in allowed):
                    continue
                yield f"{name}:{number}: {word}: {match.group(0)!r} in {line.strip()[:160]!r}"


def test_shipped_files_speak_of_the_product_only():
    hits = [hit for name, text in _shipped_files() for hit in _hits(name, text)]
    assert not hits, f"{len(hits)} forbidden word(s) in shipped files:\n" + "\n".join(hits)


def test_the_search_sees_every_kind_of_shipped_file():
    names = {name for name, _ in _shipped_files()}
    assert {"README.md", "pyproject.toml", "CHANGELOG.md", "docs/results.md",
            "trl_gspo/trainer/gspo_trainer.py"} <= names
    assert any(name.startswith(".ci/") for name in names) and any(name.startswith("recipes/") for name in names)
    assert THIS not in names


def test_the_patterns_catch_what_they_are_for_and_spare_code():
    word = "issue"  # spelled apart, so this file does not name an issue number itself
    assert len(list(_hits("docs/x.md", f"see {word} 53 and {word} #12"))) == 2
    assert not list(_hits("docs/x.md", "## Heading\ncolour #53ab00, a ratio run 0.918, 4 issues"))
    # dated figures: caught in the package and the README, left to the docs (docs/results.md holds them)
    dated = ("# measured on an H100, 2026-11-24, commit 97ce408\n"
             '"""2-core x86_64 VM (AMD EPYC), Nov 2026"""\n')
    assert {hit.split(": ")[1] for hit in _hits("trl_gspo/x.py", dated)} == {"date", "machine", "commit id"}
    assert len(list(_hits("trl_gspo/x.py", dated))) == 7
    assert list(_hits("README.md", "58 s on a 2-core VM"))
    assert not list(_hits("docs/results.md", dated))
    assert not list(_hits("trl_gspo/x.py", "# the measurement: docs/results.md#on-one-h200-2026-11-26-fsdp2\n"))
    assert not list(_hits("trl_gspo/x.py", 'ALPHABET = "0123456789abcdefghij"\nepsilon = 3e-4  # see docs/results.md\n'
                                           "sha256 = hashlib.sha256(data).hexdigest()\n"))
