"""Shipped files speak of the product only: every file `git ls-files` lists (docs, README, recipes, code and its
comments, tests, benchmarks and their logs, packaging, CI) is searched for words about how the project was made or
on which machine a figure was measured, rather than what the product does. A GPU result is named by its device,
date and what it ran, not by a run number; a reference to the project's own issue tracker or to a file outside the
repository means nothing to a user.

A hit fails the test with file:line for each one. Reword the text (the list must hold as plain words); where an
ordinary use cannot be reworded (a licence's verbatim text, another library's source code quoted in a test), add a
narrow ALLOWED entry naming the file and the phrase."""

import io
import re
import subprocess
import tokenize
from pathlib import Path

from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# name -> pattern, matched case-insensitively on each line.
FORBIDDEN = {
    "issue number": r"\bissues?\s*#?\d+\b",
    "stop number": r"\bstop \d+\b",
    "lease": r"\bleas(?:e|es|ed|ing)\b",
    "lent": r"\blent\b",
    "carry": r"\bcarr(?:y|ies|ied|ying)\b",
    "../shared": r"\.\./shared\b",
    "GPU run number": r"\bgpu[ _-]?run[ _-]?\d",
    "run number": r"\bruns? \d+\b(?![.,]\d)",  # "run 3"; a figure ("run 0.918", "run 2.3 s") is not a name
    "session": r"\bsessions?\b",
    "helper agent": r"\bhelper (?:agents?|sessions?)\b",  # "helper" alone is ordinary code vocabulary
    "subagent": r"\bsub-?agents?\b",
    "borrowed": r"\bborrow(?:s|ed|ing)?\b",
    "device time": r"\bdevice time\b",
    "budget_left": r"\bbudget_left",
    "every submission": r"\bevery submission\b",
    "room": r"\brooms?\b",
    "fix history": r"\b(?:before|until|prior to) commit\b",
}
PATTERNS = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in FORBIDDEN.items()}

# `session` is also an identifier (an HTTP client's `session`, pytest's `scope="session"`): Python names, dotted
# attributes, quoted names and Markdown code spans are code, not words.
SESSION_CODE = re.compile(r"`[^`\n]*`|[\w\]\)]\.session\b|\bsession\.\w|\"session\"")

# (file, phrase): a hit inside this phrase in this file is allowed.
ALLOWED = [
    ("LICENSE", "to carry prominent notices"),  # the Apache License 2.0, verbatim
    ("tests/test_trl_contract.py", "self.session = session"),  # TRL's own source line, asserted as it is
]


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


def _python_names(text):
    """(line, start column, end column) of every Python name token spelled `session`."""
    spans = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NAME and token.string.lower() == "session":
                spans.add((token.start[0], token.start[1], token.end[1]))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return spans


def _inside(span, spans):
    return any(start <= span[0] and span[1] <= end for start, end in spans)


def _hits(name, text):
    names = _python_names(text) if name.endswith(".py") else set()
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [m.span() for file, phrase in ALLOWED if file == name
                   for m in re.finditer(re.escape(phrase), line)]
        for word, pattern in PATTERNS.items():
            code = [m.span() for m in SESSION_CODE.finditer(line)] if word == "session" else []
            for match in pattern.finditer(line):
                span = match.span()
                if _inside(span, allowed) or _inside(span, code):
                    continue
                if word == "session" and any(line_ == number and start <= span[0] and span[1] <= end
                                             for line_, start, end in names):
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
    assert list(_hits("docs/x.md", "see issue 53, issue #12, GPU run 3 and gpu_run3.sh"))
    assert len(list(_hits("docs/x.md", "measured in this session, with the lease and the carry limit"))) == 3
    assert not list(_hits("docs/x.md", "## Heading\ncolour #53ab00, a ratio run 0.918, `session`"))
    assert not list(_hits("x.py", 'async with aiohttp.ClientSession() as session:\n    client.session.post(url)\n'
                                  '@pytest.fixture(scope="session")\n'))
    assert list(_hits("x.py", "# measured in an earlier session\n"))
