"""The docs stay short enough to read and search, counted as `wc -w` counts the Markdown source (tables and code
included):

- the pages a user reads to act (every page of docs/ except the measured figures, results.md, and the evidence page,
  moe_evidence.md): at most 25,000 words in all and 4,000 on any page. The words per page are printed
  (`pytest -s tests/test_docs_budget.py`);
- results.md, the one home of the measured figures: at most 8,000 words. A newer run replaces the one it supersedes
  (git keeps the old), so the page holds the current figure of each measurement."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_BUDGET = {"results.md", "moe_evidence.md"}
TOTAL_AT_MOST = 25_000
PAGE_AT_MOST = 4_000
RESULTS_AT_MOST = 8_000


def words_per_page() -> dict[str, int]:
    return {page.name: len(page.read_text().split()) for page in sorted((ROOT / "docs").glob("*.md"))
            if page.name not in OUTSIDE_THE_BUDGET}


def test_the_docs_fit_their_word_budget():
    counts = words_per_page()
    table = "\n".join(f"{count:6d}  docs/{name}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))
    total = sum(counts.values())
    print(f"\nwords per page (budget {TOTAL_AT_MOST} in all, {PAGE_AT_MOST} a page):\n{table}\n{total:6d}  in all")
    assert len(counts) >= 15, counts  # every page is counted
    over = {name: count for name, count in counts.items() if count > PAGE_AT_MOST}
    assert not over, f"pages over {PAGE_AT_MOST} words: {over}\n{table}"
    assert total <= TOTAL_AT_MOST, f"{total} words on the pages a user acts from (budget {TOTAL_AT_MOST}):\n{table}"


def test_the_results_page_fits_its_word_budget():
    words = len((ROOT / "docs" / "results.md").read_text().split())
    print(f"\n{words:6d}  docs/results.md (budget {RESULTS_AT_MOST})")
    assert words <= RESULTS_AT_MOST, (f"docs/results.md has {words} words (budget {RESULTS_AT_MOST}): drop the runs a "
                                      "newer one supersedes, or shorten the prose around the figures")
