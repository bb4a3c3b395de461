"""Every link in README.md and docs/*.md resolves: a relative link names a file that exists, and its `#anchor` (or a
same-page `#anchor`) names a heading of that page, slugged as the docs site's table of contents slugs it (mkdocs'
`toc` extension). Links to other sites are not fetched."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slugify(heading):
    """Python-Markdown's toc slug of a heading's text: markup dropped, ASCII, word characters, hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path):
    """The ids of a page's headings; a repeated slug gets `_1`, `_2`, ... as in the toc extension."""
    seen = []
    for _, line in _prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            slug = base = slugify(match.group(2))
            count = 0
            while slug in seen:
                count += 1
                slug = f"{base}_{count}"
            seen.append(slug)
    return set(seen)


def links(path):
    for number, line in _prose_lines(path.read_text()):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def _broken(path):
    where = path.relative_to(ROOT).as_posix()
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            yield f"{where}:{number}: {target}: no such file"
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            yield f"{where}:{number}: {target}: no heading #{anchor} in {resolved.relative_to(ROOT).as_posix()}"


@pytest.mark.parametrize("path", PAGES, ids=[path.relative_to(ROOT).as_posix() for path in PAGES])
def test_every_link_resolves(path):
    assert list(_broken(path)) == []


def test_the_readme_links_into_the_docs():
    targets = [target for _, target in links(ROOT / "README.md")]
    assert sum(target.startswith("docs/") and "#" in target for target in targets) >= 5
    assert "docs/index.md" in targets


def test_the_slugs_are_the_sites():
    assert slugify("Training on the sampler's likelihoods (paper Sec. 5.4)") == \
        "training-on-the-samplers-likelihoods-paper-sec-54"
    assert slugify("`GSPOTrainer` or `AsyncGSPOTrainer`") == "gspotrainer-or-asyncgspotrainer"
    assert slugify("On one H200, 2026-11-26: FSDP2 and the flagship's size") == \
        "on-one-h200-2026-11-26-fsdp2-and-the-flagships-size"
    assert slugify("What changes when you swap `GRPOConfig` for `GSPOConfig`") == \
        "what-changes-when-you-swap-grpoconfig-for-gspoconfig"
