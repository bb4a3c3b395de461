"""Every docs page opens with its "What to do" box: a blockquote of at most 10 lines right under the title, headed
**What to do**, holding the settings or commands a user needs from the page; derivations, measurements and history
follow it.

The source check runs in the fast suite. The `docs` tests read the built site (`pytest -m docs`, CI's docs leg, after
`mkdocs build --strict`): the box is the first block after each page's title there too, and every Markdown table kept
all its rows in rendering (a table that breaks renders as a paragraph, or loses the rows after a bad line)."""

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
IDS = [page.name for page in PAGES]
BOX_TITLE = "> **What to do**"
MAX_BOX_LINES = 10
FENCE = re.compile(r"^\s*(```|~~~)")


def _box(text):
    """The box's lines: the blockquote right after the title (blank lines between them allowed)."""
    lines = text.splitlines()
    assert lines[0].startswith("# "), "the page opens with its title"
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    box = []
    for line in rest:
        if not line.startswith(">"):
            break
        box.append(line)
    return box


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_page_opens_with_a_short_what_to_do_box(page):
    box = _box(page.read_text())
    assert box and box[0] == BOX_TITLE, f"{page.name}: the first block after the title is not `{BOX_TITLE}`"
    assert len(box) <= MAX_BOX_LINES, f"{page.name}: the box has {len(box)} lines, at most {MAX_BOX_LINES}"
    assert any(line.startswith("> - ") for line in box), f"{page.name}: the box lists nothing to do"


def test_the_docs_index_is_a_map_of_every_page():
    """docs/index.md has one line per page, saying which question it answers."""
    index = (ROOT / "docs" / "index.md").read_text()
    mapped = re.findall(r"^- \[[^\]]+\]\(([\w.]+\.md)\): .+\?$", index, flags=re.M)
    assert sorted(mapped) == sorted(page.name for page in PAGES if page.name != "index.md")


def _md_tables(text):
    """Body-row counts of the Markdown tables in a page, in order (fenced code left out)."""
    tables, fenced, rows, header = [], False, None, None
    for line in text.splitlines() + [""]:
        if FENCE.match(line):
            fenced = not fenced
        stripped = line.strip()
        if not fenced and rows is not None and stripped.startswith("|"):
            rows += 1
            continue
        if rows is not None:
            tables.append(rows)
            rows = None
        if not fenced and header is not None and re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?", stripped):
            rows = 0
        header = stripped if not fenced and stripped.startswith("|") else None
    return tables


class _TableRows(HTMLParser):
    """Body-row counts of a page's tables, in order, leaving out the tables mkdocstrings renders from docstrings
    (inside an element of class `doc`): those have no Markdown source in the page."""

    VOID = {"br", "img", "hr", "input", "meta", "link", "wbr", "col", "source"}

    def __init__(self):
        super().__init__()
        self.open, self.tables, self.body = [], [], False

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        generated = "doc" in (dict(attrs).get("class") or "").split() or any(g for _, g in self.open)
        self.open.append((tag, generated))
        if generated:
            return
        if tag == "table":
            self.tables.append(0)
        elif tag == "tbody":
            self.body = True
        elif tag == "tr" and self.body:
            self.tables[-1] += 1

    def handle_endtag(self, tag):
        while self.open:
            name, _ = self.open.pop()
            if name == tag:
                break
        if tag == "tbody":
            self.body = False


def _html_tables(html):
    parser = _TableRows()
    parser.feed(html)
    return parser.tables


def test_the_table_counter_counts_rows():
    text = "# T\n\n| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\n```text\n| x |\n|---|\n| y |\n```\n\n|a|\n|:-:|\n|1|\n"
    assert _md_tables(text) == [2, 1]
    html = "<table><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr>\n<tr><td>2</td></tr></tbody></table>"
    assert _html_tables(html) == [2]
    generated = '<div class="doc doc-contents"><p>x</p><table><tbody><tr><td>1</td></tr></tbody></table></div>'
    assert _html_tables(generated + html) == [2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site: TRL_GSPO_SITE_DIR (CI's docs leg passes the site it has just built), else a fresh
    `mkdocs build --strict` into a temporary directory."""
    given = os.environ.get("TRL_GSPO_SITE_DIR")
    if given:
        return Path(given).resolve()
    pytest.importorskip("mkdocs", reason='mkdocs is not installed: pip install -e ".[docs]" (CI\'s docs leg)')
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env=cpu_env(NO_MKDOCS_2_WARNING="1"), timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def _html(site, page):
    path = site / "index.html" if page.name == "index.md" else site / page.stem / "index.html"
    assert path.is_file(), f"{page.name} was not built ({path})"
    return path.read_text()


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_the_built_page_opens_with_the_box(site, page):
    html = _html(site, page)
    after_title = re.search(r"<h1[ >].*?</h1>\s*(<[^>]+>)\s*(<[^>]+>)\s*(<[^>]+>)([^<]*)", html, flags=re.S)
    assert after_title, f"{page.name}: no title in the built page"
    assert after_title.groups() == ("<blockquote>", "<p>", "<strong>", "What to do"), \
        f"{page.name}: the first block after the title is {after_title.group(0)[-200:]!r}"


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_table_lost_rows_in_rendering(site, page):
    text = page.read_text()
    assert _html_tables(_html(site, page)) == _md_tables(text), f"{page.name}: body rows per table, HTML vs Markdown"


def _browser() -> str:
    """A headless Chromium: CI's docs leg installs Debian's `chromium`."""
    import shutil

    found = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)),
                 None)
    if found is None:
        pytest.skip("no headless browser (chromium) on this machine: apt-get install chromium")
    return found


def _rendered(page_html: Path) -> str:
    """The page's DOM after its scripts ran in a real browser (headless Chromium, from the file: no network)."""
    result = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                             "--virtual-time-budget=15000", "--dump-dom", page_html.as_uri()],
                            capture_output=True, text=True, timeout=120, env=cpu_env())
    assert result.returncode == 0 and "</html>" in result.stdout, result.stderr[-2000:]
    return result.stdout


MATH_PAGES = [page for page in PAGES if re.search(r"\$\$|(?<![\\$])\$[^$\s][^$]*\$", page.read_text())]


@pytest.mark.docs
def test_the_pages_hold_latex_not_code_blocks_of_math():
    assert any(page.name == "gspo.md" for page in MATH_PAGES), [page.name for page in MATH_PAGES]


@pytest.mark.docs
@pytest.mark.parametrize("page", MATH_PAGES, ids=[page.name for page in MATH_PAGES])
def test_equations_render_in_a_browser(site, page):
    """Every equation of the page is typeset by the site's own KaTeX (no CDN: the site is read from disk): one
    `katex` element per `arithmatex` element, no KaTeX error, and no LaTeX delimiter left in the page's text."""
    path = site / page.stem / "index.html"
    built = path.read_text()
    expected = len(re.findall(r'class="arithmatex"', built))
    assert expected > 0, f"{page.name}: no math in the built page"
    assert "cdn" not in "".join(re.findall(r'<script[^>]+src="([^"]+)"', built)).lower()
    dom = _rendered(path)
    rendered = len(re.findall(r'<span class="katex(?:-display)?">', dom))
    typeset = len(re.findall(r'<span class="katex">', dom))
    assert typeset >= expected, f"{page.name}: {typeset} equations typeset of {expected} ({rendered} spans)"
    assert "katex-error" not in dom, re.search(r'katex-error[^>]*>([^<]*)', dom).group(1)
    text = re.sub(r"<annotation[^>]*>.*?</annotation>", "", re.sub(r"<script.*?</script>", "", dom, flags=re.S),
                  flags=re.S)
    assert "$$" not in text and "\\[" not in text and "\\(" not in text, f"{page.name}: raw LaTeX left"
