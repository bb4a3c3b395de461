"""A measured figure has one home: docs/results.md, each figure with its machine, date or commit and command
(docs/moe_evidence.md holds its own experiments' figures, with theirs). README.md and the other docs pages quote a
figure only beside a link to that home, and quote it as the home states it.

1. No figure without its home: a paragraph, list item, table row or heading of README.md or of a docs page other
   than the two homes that states a measured figure also links results.md (or moe_evidence.md). A measured figure
   (FIGURE) is a number with a unit of time (ms, s, min, h, or spelled out), of memory (GiB, GB, MiB, MB), a
   percentage, a speed ratio (`1.02x`, `1.9×`; an integer one only before "faster", "slower", ...), a rate
   (`tokens/s`), or a reward stated as measured (`0.61 -> 0.96`, `0.613 → 0.960`, `reward 0.47`). Not figures:
   numbers without a unit (versions such as 1.16, config values such as 3e-4, dates), products (`4 x 6.6 GB` counts
   only the GB), fenced and indented code, code spans (`max_steps: 30`), math, link targets, and a GPU's memory
   (`80 GB GPUs`, `H100 80GB`). A setting that carries a unit (a timeout's default), the paper's own figures and
   arithmetic from a model's shape are figures to the pattern: NOT_MEASURED lists each by page and phrase, with the
   reason. The generated recipe table of docs/recipes.md is left out: its memory figures are the recipe cards'
   estimates, which tests/test_readme.py requires to say so.
2. A quoted figure equals its home: where a paragraph, list item or table row with figures links sections of the
   homes (`results.md#anchor`), each of its numbers occurs in one of those sections (from the heading to the next
   heading of the same or a higher level; an anchor is the heading's mkdocs slug), with the same unit, to the digits
   quoted (0.805 is quoted as 0.81). A reward `a -> b` must match a pair of the section. The figures in the README's
   code comments occur in a section the README links.
3. The docs' first screen answers what a GRPO user asks first (FIRST_SCREEN).
4. The README's first paragraph says what routing replay is for: GRPO on MoE needs it, GSPO (the paper says) does
   not, as docs/choosing.md says.

Same spirit as tests/test_shipped_words.py, which keeps dates, machines and commits out of the package and the README:
a figure lives with its provenance in docs/results.md; elsewhere it is a link."""

import ast
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from test_links import slugify  # mkdocs' heading ids, one rule for both tests

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOMES = ("results.md", "moe_evidence.md")
PAGES = [ROOT / "README.md", *(page for page in sorted(DOCS.glob("*.md")) if page.name not in HOMES)]
IDS = [page.relative_to(ROOT).as_posix() for page in PAGES]

NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
SPAN = rf"{NUMBER}(?:\s?(?:-|–|to)\s?{NUMBER})?"  # one number or a range: 58-109 s, 10 to 20 GB
START = r"(?<![\w.])"
FIGURE = re.compile(
    rf"{START}(?P<time>{SPAN})\s?(?P<time_unit>ms|s|sec|seconds?|min|minutes?|h|hours?)(?:/[a-z]+)?(?!\w)"
    rf"|{START}(?P<memory>{SPAN})\s?(?P<memory_unit>GiB|GB|MiB|MB)(?!\w)"
    rf"|{START}(?P<percent>{SPAN})\s?%"
    rf"|{START}(?P<rate>{SPAN})\s?(?P<rate_unit>tokens?|tok|samples?|steps?|it)/s(?!\w)"
    rf"|{START}(?P<ratio>\d+\.\d+)(?:[x×]|\s×)(?!\w)"
    rf"|{START}(?P<int_ratio>\d+)\s?[x×]\s(?=faster|slower|speed|as fast|the time|longer|shorter)"
    rf"|{START}(?P<first>\d*\.\d+)\s?(?:->|→)\s?(?P<last>\d*\.\d+)(?!\d|\.\d)"
    r"|\breward\s+(?:of\s+)?(?P<reward>\d*\.\d+)(?!\d|\.\d)(?!\s?(?:->|→))"
)
UNIT_NAMES = {"sec": "s", "second": "s", "seconds": "s", "minute": "min", "minutes": "min", "hour": "h", "hours": "h",
              "token": "tokens", "tok": "tokens", "sample": "samples", "step": "steps"}
# A GPU's memory, not a measurement: "80 GB GPUs", "an 80 GB GPU", "H100 80GB", "8x H200 141GB".
GPU_BEFORE = re.compile(r"\b[ABHL]\d{2,3}\s?$")
GPU_AFTER = re.compile(r"^\s?GPUs?\b")

# (page, phrase, why): a figure inside this phrase of this page is not a measurement. Keep each phrase narrow.
SETTING, PAPER, ARITHMETIC, RULE = ("a setting or a default", "the paper's figure", "arithmetic from a shape",
                                    "a constant of a rule")
NOT_MEASURED: list[tuple[str, str, str]] = [
    ("docs/gpus.md", "waits up to 600 s", SETTING),
    ("docs/gpus.md", "the probe retries for 5 s", SETTING),
    ("docs/gpus.md", "about 61 GB of bf16 weights", ARITHMETIC),
    ("docs/gspo.md", "paper reports about 15% of tokens", PAPER),
    ("docs/gspo.md", "at least 84% of learnable tokens", RULE),
    ("docs/gspo.md", "at most 14% a step", RULE),
    ("docs/gspo.md", "1.5x clear of", RULE),
    ("docs/lora.md", "about 54 GiB (48 layers", ARITHMETIC),
    ("docs/metrics.md", "the paper's per-update figure, ~10% on Qwen3-30B-A3B", PAPER),
    ("docs/metrics.md", "(the paper: ~15% of tokens against ~0.13%)", PAPER),
    ("docs/own_task.md", "| 300 s |", SETTING),
    ("docs/own_task.md", "training stops after 300 s", SETTING),
    ("docs/own_task.md", "(1800 s)", SETTING),
    ("docs/own_task.md", "| 600 s |", SETTING),
    ("docs/own_task.md", "rewards over 600 s", SETTING),
    ("docs/recipes.md", "waits 0.1 s", SETTING),
    ("docs/reliability.md", "(default 300 s)", SETTING),
    ("docs/reliability.md", "SIGKILL after 30 s", SETTING),
    ("docs/reliability.md", "1800 s; on one node", SETTING),
    ("docs/reliability.md", "for 30 minutes", SETTING),
    ("docs/reliability.md", "within 60 s of the fault", SETTING),
    ("docs/reliability.md", "a Hub silent for 3 s", SETTING),
]
# The table docs/recipes.md generates from the recipe cards (tests/test_readme.py): estimates, each saying so.
GENERATED = ("<!-- recipe table", "<!-- end of recipe table")

FENCE = re.compile(r"^(```|~~~|\$\$)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")
# A link to a home, or its path: results.md, docs/results.md#anchor, ../moe_evidence.md#1-the-mechanism.
HOME_LINK = re.compile(r"(?:^|(?<=[(\s/]))(?:docs/)?(results|moe_evidence)\.md(?:#([\w-]+))?(?![\w.])")
# Spans where a figure is not prose: code spans, inline math, link targets, HTML comments.
NOT_PROSE = re.compile(r"`[^`]*`|\$[^$]+\$|\]\([^)]*\)|<!--.*?-->")


def units(text):
    """(first line number, text) of each paragraph, list item, table row and heading of a Markdown page, outside
    fenced and indented code, display math and the generated recipe table; blockquote markers dropped, a unit's lines
    joined by single spaces."""
    found, lines, start, fence, generated, indented_code, after_blank = [], [], 0, None, False, False, True

    def flush():
        if lines:
            found.append((start, " ".join(lines)))
            lines.clear()

    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"^\s*>\s?", "", raw)
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith(GENERATED[0]):
            flush()
            generated = True
        if generated:
            generated = not stripped.startswith(GENERATED[1])
            continue
        opened = FENCE.match(stripped)
        if opened:
            flush()
            if not (opened.group(1) == "$$" and len(stripped) > 2 and stripped.endswith("$$")):
                fence = opened.group(1)
            continue
        if not stripped:
            flush()
            after_blank = True
            continue
        if line.startswith("    ") and not ITEM.match(line) and (indented_code or after_blank and not lines):
            indented_code, after_blank = True, False  # an indented code block: 4 spaces after a blank line
            continue
        indented_code = after_blank = False
        if stripped.startswith("|") or HEADING.match(stripped):
            flush()
            found.append((number, stripped))
            continue
        if ITEM.match(line):
            flush()
        if not lines:
            start = number
        lines.append(stripped)
    flush()
    return found


def _not_prose(text):
    return [match.span() for match in NOT_PROSE.finditer(text)]


def _not_measured(name, text):
    return [match.span() for page, phrase, _ in NOT_MEASURED if page == name
            for match in re.finditer(re.escape(phrase), text)]


def figures(name, text):
    """The measured figures (FIGURE matches) of one unit of page `name`, less code, links, GPU sizes and NOT_MEASURED."""
    skip = _not_prose(text) + _not_measured(name, text)
    for match in FIGURE.finditer(text):
        if any(start <= match.start() and match.end() <= end for start, end in skip):
            continue
        if any(start < match.end() and match.start() < end for start, end in _not_prose(text)):
            continue  # straddles a code span or a link target
        if match.group("memory") and (GPU_BEFORE.search(text[:match.start()])
                                      or GPU_AFTER.match(text[match.end():])):
            continue
        yield match


def home_links(text):
    """(page, anchor or None) of each link to a home in a unit."""
    return [(f"{page}.md", anchor) for page, anchor in HOME_LINK.findall(text)]


def unlinked(name, text):
    for number, unit in units(text):
        if home_links(unit):
            continue
        for match in figures(name, unit):
            yield f"{name}:{number}: {match.group(0)!r} without a link to results.md in: {unit[:200]!r}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_figure_links_its_home(page):
    """Give the figure a link to the results.md section that holds it (in the same paragraph, list item or table
    row), or delete it where results.md does not hold it; a setting, the paper's figure or arithmetic goes in
    NOT_MEASURED."""
    name = page.relative_to(ROOT).as_posix()
    hits = list(unlinked(name, page.read_text()))
    assert not hits, f"{len(hits)} figure(s) away from their home:\n" + "\n".join(hits)


def test_every_not_measured_phrase_is_still_on_its_page():
    """An entry whose phrase left its page is stale: remove it, so the list stays as narrow as the text."""
    stale = [(page, phrase) for page, phrase, _ in NOT_MEASURED
             if phrase not in " ".join(unit for _, unit in units((ROOT / page).read_text()))]
    assert not stale, stale


def test_the_figure_pattern_catches_figures_and_spares_the_rest():
    planted = {
        "took 58 s": "58 s", "58-109 s on 2 cores": "58-109 s", "27.27 ms per decode step": "27.27 ms",
        "trains: 5.94 s/step": "5.94 s/step", "for 30 minutes": "30 minutes", "in 2 h": "2 h",
        "peak 45.1 GiB": "45.1 GiB", "191 MiB": "191 MiB", "~26 GB of weights": "26 GB", "1,218 MB": "1,218 MB",
        "generation 74% of a step": "74%", "0.35% of CUDA time": "0.35%", "ratio 1.02x": "1.02x",
        "1.9× faster": "1.9×", "2x faster": "2x ", "1200 tokens/s": "1200 tokens/s",
        "reward 0.61 -> 0.96": "0.61 -> 0.96", "0.613 → 0.960": "0.613 → 0.960", "seed 1 at reward 0.47": "reward 0.47",
    }
    for text, figure in planted.items():
        assert [match.group(0) for match in figures("docs/x.md", text)] == [figure], text
    spared = [
        "trl 1.16, transformers 5.23, peft `>=0.21.2,<0.22`", "epsilon 3e-4 / 4e-4, clip_band_max 0.2",
        "`max_steps: 30`", "`--timeout 600 s`", "2026-11-28, commit 4c52dcd", "4 x gradient_accumulation_steps",
        "each rollout generates 4x the completions", "a band 100x wider", "8 steps, 4 mini-batches, top-8 experts",
        "TP 2 x DP 2 on GPUs 4-7", "lengths 12-63", "on 80 GB GPUs", "an 80 GB GPU", "8x H200 141GB", "1 H100 80GB",
        "8 rewards of 0.9", "the 95th percentile", "[results](results.md#on-one-h200-2026-11-26-fsdp2)", "$1.5 s$",
        "python 3.10 scripts", "Sec. 5.3 says", "`routing_replay_min_agreement` (0.75)",
    ]
    for text in spared:
        assert not list(figures("docs/x.md", text)), text
    # NOT_MEASURED spares its phrase on its page only
    assert not list(figures("docs/reliability.md", "the default (default 300 s) holds"))
    assert list(figures("docs/gspo.md", "the default (default 300 s) holds"))


def test_units_are_paragraphs_items_and_rows():
    text = ("# T\n\n> **What to do**\n>\n> - took 5 s\n>   on two lines ([r](results.md#a))\n\nA paragraph of 3 s\n"
            "over lines.\n\n- an item 4 s\n  continued\n- next 9 s\n\n| a | 7 s |\n| b | 8 s ([r](results.md#b)) |\n\n"
            "```bash\necho 58 s\n```\n\n    indented 6 s\n\n$$\nx = 2 s\n$$\n\n<!-- recipe table: x -->\n| c | 1 s |\n"
            "<!-- end of recipe table -->\n")
    assert [unit for _, unit in units(text)] == [
        "# T", "**What to do**", "- took 5 s on two lines ([r](results.md#a))", "A paragraph of 3 s over lines.",
        "- an item 4 s continued", "- next 9 s", "| a | 7 s |", "| b | 8 s ([r](results.md#b)) |"]
    assert [hit.split(": ")[1] for hit in unlinked("docs/x.md", text)] == ["'3 s' without a link to results.md in",
                                                                             "'4 s' without a link to results.md in",
                                                                             "'9 s' without a link to results.md in",
                                                                             "'7 s' without a link to results.md in"]
    assert home_links("see [r](results.md#a), docs/results.md, [m](../moe_evidence.md#1-the-mechanism-per-token)") \
        == [("results.md", "a"), ("results.md", ""), ("moe_evidence.md", "1-the-mechanism-per-token")]
    assert not home_links("see my_results.md and results.mdx")


# --- 2. a quoted figure equals its home ---

def sections(text):
    """slug -> the section's text, from its heading to the next heading of the same or a higher level (fenced code
    left out of the heading search); a repeated slug gets `_1`, `_2`, ... as in mkdocs."""
    lines, headings, fence = text.splitlines(), [], None
    for index, line in enumerate(lines):
        stripped = line.strip()
        if fence:
            fence = None if stripped.startswith(fence) else fence
            continue
        opened = FENCE.match(stripped)
        if opened and opened.group(1) != "$$":
            fence = opened.group(1)
            continue
        match = HEADING.match(line)
        if match:
            headings.append((index, len(match.group(1)), match.group(2)))
    found, seen = {}, set()
    for position, (index, level, title) in enumerate(headings):
        end = next((later for later, later_level, _ in headings[position + 1:] if later_level <= level), len(lines))
        slug = base = slugify(title)
        count = 0
        while slug in seen:
            count += 1
            slug = f"{base}_{count}"
        seen.add(slug)
        found[slug] = "\n".join(lines[index:end])
    return found


def _kind(match):
    """('arrow' | 'reward' | a unit, the numbers) of a FIGURE match."""
    if match.group("first"):
        return "arrow", (match.group("first"), match.group("last"))
    if match.group("reward"):
        return "reward", (match.group("reward"),)
    for group, unit in (("time", "time_unit"), ("memory", "memory_unit"), ("rate", "rate_unit")):
        if match.group(group):
            name = match.group(unit)
            return UNIT_NAMES.get(name, name), tuple(re.findall(NUMBER, match.group(group)))
    if match.group("percent"):
        return "%", tuple(re.findall(NUMBER, match.group("percent")))
    return "x", (match.group("ratio") or match.group("int_ratio"),)


def same(quoted, measured):
    """`quoted` states `measured`: equal, or `measured` rounded half up to the digits `quoted` gives."""
    q, m = Decimal(quoted.replace(",", "")), Decimal(measured.replace(",", ""))
    places = -q.as_tuple().exponent
    if -m.as_tuple().exponent <= places:
        return q == m
    return m.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP) == q


def _stated(kind, numbers, home_text):
    home = [_kind(match) for match in FIGURE.finditer(home_text)]
    if kind == "arrow":
        return any(other == "arrow" and same(numbers[0], pair[0]) and same(numbers[1], pair[1])
                   for other, pair in home)
    if kind == "reward":
        return any(same(numbers[0], number) for number in re.findall(NUMBER, home_text))
    return all(any(other == kind and any(same(number, value) for value in values) for other, values in home)
               for number in numbers)


def _homes():
    return {page: sections((DOCS / page).read_text()) for page in HOMES}


def misquoted(name, text, homes):
    """Each figure of a unit that links home sections and is not stated in any of them."""
    for number, unit in units(text):
        links = home_links(unit)
        quoted = list(figures(name, unit))
        if not links or not quoted:
            continue
        texts = []
        for page, anchor in links:
            if not anchor:
                texts.append("\n".join(homes[page].values()))
            elif anchor in homes[page]:
                texts.append(homes[page][anchor])
            else:
                yield f"{name}:{number}: {page}#{anchor}: no such section (headings: {sorted(homes[page])[:8]} ...)"
        for match in quoted:
            kind, numbers = _kind(match)
            if not any(_stated(kind, numbers, home) for home in texts):
                yield (f"{name}:{number}: {match.group(0)!r} is in none of the linked sections "
                       f"{[f'{page}#{anchor}' for page, anchor in links]}: {unit[:160]!r}")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_quoted_figures_equal_the_sections_they_link(page):
    name = page.relative_to(ROOT).as_posix()
    wrong = list(misquoted(name, page.read_text(), _homes()))
    assert not wrong, "\n".join(wrong)


def test_the_readme_quotes_the_results_it_links():
    """The README's figure rows and sentences link results.md sections (so the test above checks them), and the
    figures in its code comments (the quickstart's time, the suite's time) are stated in a section the README
    links."""
    readme = (ROOT / "README.md").read_text()
    quoting = [unit for _, unit in units(readme) if list(figures("README.md", unit))]
    assert len(quoting) >= 3 and all(home_links(unit) for unit in quoting)
    homes = _homes()
    linked = [homes[page][anchor] for _, unit in units(readme) for page, anchor in home_links(unit)
              if anchor in homes[page]]
    comments = [line.split("# ", 1)[1] for block in re.findall(r"```\w*\n(.*?)```", readme, flags=re.S)
                for line in block.splitlines() if "# " in line]
    quoted = [match for comment in comments for match in figures("README.md", comment)]
    assert quoted, "the README's commands no longer state their times: this check has nothing to check"
    unstated = [match.group(0) for match in quoted if not any(_stated(*_kind(match), home) for home in linked)]
    assert not unstated, f"README code comments state {unstated}, in no results.md section the README links"


def test_the_quote_check_finds_a_number_its_section_lacks():
    results = ("# Results\n\n## The quickstarts on CPU\n\nseed 0: 0.613 -> 0.960, whole command 109 s; 58 s alone; "
               "0.531 -> 0.805.\n\n### A subsection\n\n0.608 -> 0.968, 174 s.\n\n## Test suite times\n\n142 s, 35%.\n")
    homes = {"results.md": sections(results), "moe_evidence.md": {}}
    assert set(homes["results.md"]) == {"results", "the-quickstarts-on-cpu", "a-subsection", "test-suite-times"}
    assert "174 s" in homes["results.md"]["the-quickstarts-on-cpu"]
    assert "142 s" not in homes["results.md"]["the-quickstarts-on-cpu"]
    good = ("| addition | 0.61 -> 0.96 | [58-109 s](docs/results.md#the-quickstarts-on-cpu) |\n"
            "| tools | 0.53 -> 0.81 | [174 s](docs/results.md#the-quickstarts-on-cpu) |\n"
            "| ddp | 0.61 -> 0.97 | [35%](docs/results.md#test-suite-times), [174 s](docs/results.md#a-subsection) |\n")
    assert not list(misquoted("README.md", good, homes))
    for bad in ["| x | 0.62 -> 0.96 | [58 s](docs/results.md#the-quickstarts-on-cpu) |",  # a reward not there
                "| x | 0.96 -> 0.61 | [58 s](docs/results.md#the-quickstarts-on-cpu) |",  # a pair reversed
                "| x | 0.61 -> 0.96 | [57 s](docs/results.md#the-quickstarts-on-cpu) |",  # a time not there
                "| x | 0.61 -> 0.96 | [142 s](docs/results.md#the-quickstarts-on-cpu) |",  # in another section
                "| x | 0.61 -> 0.96 | [58 ms](docs/results.md#the-quickstarts-on-cpu) |",  # another unit
                "| x | 35% | [58 s](docs/results.md#no-such-section) |"]:
        assert list(misquoted("README.md", bad, homes)), bad
    assert same("0.81", "0.805") and same("0.96", "0.960") and same("5", "4.7") and same("1,218", "1218")
    assert not same("0.81", "0.8") and not same("0.61", "0.6151") and not same("58", "57.4")
    assert slugify("On one H200, 2026-11-26: FSDP2 and the flagship's size") == \
        "on-one-h200-2026-11-26-fsdp2-and-the-flagships-size"
    assert slugify("R3's routes in server mode at the flagship's size") == \
        "r3s-routes-in-server-mode-at-the-flagships-size"
    assert slugify("`AsyncGSPOTrainer` checks on CPU") == "asyncgspotrainer-checks-on-cpu"


# --- 3. the first screen ---

FIRST_SCREEN = 40  # lines of Markdown source after the title line


def first_screen(page):
    """A page's first screen: the first FIRST_SCREEN lines of its Markdown source after the title line."""
    lines = (DOCS / page).read_text().splitlines()
    assert lines[0].startswith("# "), page
    return "\n".join(lines[1:1 + FIRST_SCREEN])


def _config_defaults():
    """The paper's band and the defaults of `routing_replay` and `clip_band`, read from trl_gspo/config.py's source
    (no import: this file stays fast)."""
    tree = ast.parse((ROOT / "trl_gspo" / "config.py").read_text())
    constants, defaults = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("PAPER_EPSILON_LOW", "PAPER_EPSILON_HIGH"):
                constants[name] = ast.literal_eval(node.value)
            if name == "CLIP_BAND_FIELDS":
                for key, value in zip(node.value.keys, node.value.values):
                    if ast.literal_eval(key) == "clip_band":
                        defaults["clip_band"] = next(ast.literal_eval(k.value) for k in value.keywords
                                                     if k.arg == "default")
        if isinstance(node, ast.ClassDef) and node.name == "GSPOConfig":
            for statement in node.body:
                if (isinstance(statement, ast.AnnAssign) and getattr(statement.target, "id", None) == "routing_replay"):
                    defaults["routing_replay"] = next(ast.literal_eval(k.value) for k in statement.value.keywords
                                                      if k.arg == "default")
    return constants, defaults


def _short(value):
    """3e-4 as the docs write it: `0.0003` -> "3e-4"."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def questions():
    """question -> the terms one paragraph or list item of the first screen must hold to answer it."""
    constants, defaults = _config_defaults()
    return {
        "How do I switch from GRPO?": ["GRPOTrainer", "GSPOTrainer", "GSPOConfig", "trl_gspo", 'loss_type="gspo"'],
        "Which band runs, and why?": [_short(constants["PAPER_EPSILON_LOW"]), _short(constants["PAPER_EPSILON_HIGH"]),
                                      "epsilon", "per sequence", f'clip_band="{defaults["clip_band"]}"', "why"],
        "Do I replay MoE routes?": [f'routing_replay="{defaults["routing_replay"]}"', "GSPO", "GRPO", "MoE", "paper",
                                    '"old"', "R3", "vLLM"],
        "What does it cost?": ["per step", "results.md#"],
    }


def test_the_first_screen_answers_a_grpo_users_questions():
    """docs/index.md or docs/choosing.md answers in its first screen (the first 40 lines of its Markdown source after
    the title line): how to switch from GRPO (the import, `loss_type="gspo"`), which band runs and why (the paper's
    3e-4 / 4e-4, per sequence, `clip_band`'s default, as trl_gspo/config.py sets them), whether to replay MoE routes
    (`routing_replay`'s default for GSPO, `"old"` for GRPO, R3 with vLLM) and what a step costs (linked to
    results.md). Each answer is one paragraph or list item holding all of its terms."""
    screens = {page: [unit for _, unit in units(first_screen(page))] for page in ("index.md", "choosing.md")}
    unanswered = {question: terms for question, terms in questions().items()
                  if not any(all(term in unit for term in terms) for page in screens for unit in screens[page])}
    assert not unanswered, f"not answered in the first screen of docs/index.md or docs/choosing.md: {unanswered}"


def test_the_defaults_are_read_from_the_config():
    constants, defaults = _config_defaults()
    assert (_short(constants["PAPER_EPSILON_LOW"]), _short(constants["PAPER_EPSILON_HIGH"])) == ("3e-4", "4e-4")
    assert defaults == {"clip_band": "fixed", "routing_replay": "none"}


# --- 4. the README's first paragraph ---

def test_the_readmes_first_paragraph_says_what_routing_replay_is_for():
    """As docs/choosing.md says: GRPO on MoE needs routing replay (the paper's baseline), GSPO does not (the paper)."""
    blocks = (ROOT / "README.md").read_text().split("\n\n")
    first = blocks[1] if blocks[0].startswith("# ") else blocks[0]
    assert re.search(r"routing replay", first, flags=re.I), first
    assert re.search(r"\bGRPO\b", first) and re.search(r"Mixture-of-Experts|\bMoE\b", first), first
    assert re.search(r"GSPO needs (?:none|no)", first), first
