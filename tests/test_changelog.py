"""CHANGELOG.md is a changelog a user can read (Keep a Changelog): short, one section per release, newest first, each
group heading once per release, each change stated once, and no measured figures (those live in docs/results.md,
which the changelog links). Read from the file only: no network, no imports of the package."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
MAX_WORDS = 2000
GROUPS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\S+))?\s*$")
VERSION = re.compile(r"^\d+\.\d+\.\d+$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

# A measured figure: a number with a unit of time, size, rate, ratio or share ("1.9x faster", "58 s", "20 GB",
# "12 %", "3,000 tokens/s"). Not a version (1.16, 0.1.0), a config value (3e-4, 0.75, `max_steps` -1), a date, a
# count of things ("4 mini-batches") or a name with digits (H200, Qwen3-30B-A3B).
UNIT = (r"%|×|x\b|(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?|days?"
        r"|[KMGT]i?B|tokens?/s|it/s|samples?/s|steps?/s)\b")
FIGURE = re.compile(rf"(?<![\w.])\d+(?:[.,]\d+)*\s*(?:{UNIT})", re.IGNORECASE)

# A dotted `trl_gspo.` name, as tests/test_doc_names.py reads the docs; one left of "→" is a name that moved away.
NAME = re.compile(r"(?<![\w./-])trl_gspo(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text() -> str:
    return CHANGELOG.read_text()


def _releases() -> list[tuple[str, str | None, str]]:
    """(name, date, body) of each `## [...]` section, in file order."""
    releases, current = [], None
    for line in _text().splitlines():
        match = RELEASE.match(line)
        if match:
            current = [match.group("name"), match.group("date"), []]
            releases.append(current)
        elif line.startswith("## "):
            raise AssertionError(f"a second-level heading that is not a release: {line!r}")
        elif current is not None:
            current[2].append(line)
    return [(name, date, "\n".join(body)) for name, date, body in releases]


def _bullets(body: str) -> list[str]:
    """Each bullet of a section with its continuation lines, whitespace collapsed and lower-cased."""
    bullets: list[list[str]] = []
    for line in body.splitlines():
        item = re.match(r"^\s*[-*] (.*)", line)
        if item:
            bullets.append([item.group(1)])
        elif bullets and line.startswith(" ") and line.strip():
            bullets[-1].append(line.strip())
    return [" ".join(" ".join(parts).split()).lower() for parts in bullets]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_figure_pattern_catches_figures_and_spares_settings():
    for figure in ("1.9x faster", "2x narrower", "4.3 ×", "58 s on two cores", "12.4 s", "34 min", "191 s",
                   "6.4 GB peak", "25.8 GiB", "512 MiB", "90%", "0.19 %", "3,000 tokens/s", "2.5 it/s", "1.03-1.15x"):
        assert FIGURE.search(figure), figure
    for setting in ("eps 3e-4", "epsilon=3e-4, epsilon_high=4e-4", "clip_band_target (0.15)", "TRL 1.16",
                    "transformers 5.21.1 to 5.24", "## [0.1.0] - 2026-11-24", "4 mini-batches per rollout batch",
                    "eight H200s", "Qwen3-30B-A3B", "`max_steps` -1", "routing_replay_min_agreement (0.75)",
                    "default 600, in seconds", "ZeRO-2/3", "Sec. 5.4", "arXiv 2507.18071",
                    "16 transformers MoE families",
                    "1e-5, 0.2", "equations 5-7 and 10-11", "safetensors>=0.8,<1"):
        assert not FIGURE.search(setting), setting


def test_the_changelog_is_short():
    words = len(_text().split())
    assert words <= MAX_WORDS, f"CHANGELOG.md has {words} words (at most {MAX_WORDS}): merge or drop entries"


def test_releases_are_unreleased_then_versions_newest_first_each_dated():
    releases = _releases()
    names = [name for name, _, _ in releases]
    assert names[0] == "Unreleased" and releases[0][1] is None, names
    versions = names[1:]
    assert versions, "no released version"
    for name, date, _ in releases[1:]:
        assert VERSION.match(name), f"not a version: [{name}]"
        assert date and DATE.match(date), f"[{name}] has no date (## [{name}] - YYYY-MM-DD)"
    assert versions == sorted(versions, key=_key, reverse=True), f"versions not newest first: {versions}"
    assert len(set(versions)) == len(versions), versions
    dates = [date for _, date, _ in releases[1:]]
    assert dates == sorted(dates, reverse=True), f"dates not newest first: {dates}"
    project = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert project in versions, f"pyproject.toml's version {project} has no section"


def test_each_group_heading_once_per_release():
    for name, _, body in _releases():
        headings = [line[4:].strip() for line in body.splitlines() if line.startswith("### ")]
        for heading in headings:
            assert heading in GROUPS or re.fullmatch(r"Upgrading from \d+\.\d+\.\d+", heading), \
                f"[{name}]: ### {heading} is neither a group ({', '.join(GROUPS)}) nor 'Upgrading from X.Y.Z'"
        repeated = {heading for heading in headings if headings.count(heading) > 1}
        assert not repeated, f"[{name}] repeats ### {', '.join(sorted(repeated))}: merge them"
        assert not re.search(r"^#{4,} ", body, re.MULTILINE), f"[{name}]: headings below ### split a group"


def test_unreleased_says_how_to_upgrade_from_the_latest_release():
    releases = _releases()
    if len(releases) < 2 or not _bullets(releases[0][2]):
        return
    latest = releases[1][0]
    upgrading = re.search(rf"^### Upgrading from {re.escape(latest)}\n(.*?)(?=^### |\Z)", releases[0][2],
                          re.MULTILINE | re.DOTALL)
    assert upgrading and _bullets(upgrading.group(1)), f"[Unreleased] needs a '### Upgrading from {latest}' list"


def test_no_change_is_stated_twice():
    for name, _, body in _releases():
        bullets = _bullets(body)
        repeated = sorted({bullet for bullet in bullets if bullets.count(bullet) > 1})
        assert not repeated, f"[{name}] states these more than once:\n" + "\n".join(b[:120] for b in repeated)


def test_no_measured_figures():
    hits = [f"CHANGELOG.md:{number}: {match.group(0)!r} in {line.strip()[:120]!r}"
            for number, line in enumerate(_text().splitlines(), 1) for match in FIGURE.finditer(line)]
    assert not hits, "measured figures belong in docs/results.md (link it):\n" + "\n".join(hits)


def test_links_name_files_that_exist():
    for target in LINK.findall(_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = ROOT / target.split("#", 1)[0]
        assert path.exists(), f"CHANGELOG.md links {target}, which does not exist"


def _resolves(dotted: str) -> bool:
    """Statically: the longest prefix that is a module or package under trl_gspo/, then each remaining part named in
    that module's source (defined, assigned or imported there)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            text = source.read_text()
            return all(re.search(rf"\b{re.escape(part)}\b", text) for part in parts[cut:])
    return False


def _clauses() -> list[str]:
    """The changelog's text with each bullet on one line, cut at ";": a clause "old → new" renames."""
    text = re.sub(r"\n[ \t]+(?![-*] )", " ", _text())
    return [clause for line in text.splitlines() for clause in line.split(";")]


def test_every_current_dotted_name_exists():
    missing = []
    for clause in _clauses():
        arrow = clause.find("→")
        for match in NAME.finditer(clause):
            if 0 <= arrow and match.start() < arrow:
                continue  # the name a module had before it moved
            if not _resolves(match.group(0)):
                missing.append(f"{match.group(0)} in {clause.strip()[:120]!r}")
    assert not missing, "CHANGELOG.md names what trl_gspo/ does not hold:\n" + "\n".join(missing)
    assert _resolves("trl_gspo.losses.gspo_packed_loss") and not _resolves("trl_gspo.no_such_module")


def _config_defaults(path: Path) -> dict:
    """Module constants and each dataclass field's default of a config module, read with `ast` (no import):
    `name: T = field(default=X)`, `field(**SHARED)` and `field(**SHARED["name"])` with `SHARED = dict(default=X)`."""
    tree = ast.parse(path.read_text())
    constants, shared, defaults = {}, {}, {}

    def value(node):
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None

    def call_default(call):
        for keyword in call.keywords:
            if keyword.arg == "default":
                return value(keyword.value)
            if keyword.arg is None:  # **SHARED or **SHARED["name"]
                target = keyword.value
                if isinstance(target, ast.Subscript):
                    return shared.get((target.value.id, value(target.slice)))
                return shared.get((target.id, None))
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if isinstance(node.value, ast.Call):
                shared[(name, None)] = call_default(node.value)
            elif isinstance(node.value, ast.Dict):
                for key, item in zip(node.value.keys, node.value.values):
                    if isinstance(item, ast.Call):
                        shared[(name, value(key))] = call_default(item)
            else:
                constants[name] = value(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Call):
            defaults[node.target.id] = call_default(node.value)
    return {**constants, **defaults}


def _num(x) -> str:
    """A number as the changelog writes it: 600, 0.75, 3e-4, 1e-5."""
    text = f"{x:g}" if x == 0 or abs(x) >= 1e-3 else f"{x:.0e}"
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", text)


def test_the_defaults_the_changelog_states_are_the_code_s():
    """A default is a promise: the changelog's statements of them change with the code."""
    sync = _config_defaults(ROOT / "trl_gspo" / "config.py")
    asynchronous = _config_defaults(ROOT / "trl_gspo" / "async_trainer" / "config.py")
    text = " ".join(_text().split())
    stated = {
        f'`epsilon={_num(sync["PAPER_EPSILON_LOW"])}`, `epsilon_high={_num(sync["PAPER_EPSILON_HIGH"])}` '
        f'(`clip_band="{sync["clip_band"]}"`, the default)': sync["clip_band"] == "fixed",
        f'`rank_wait_timeout` (default {_num(sync["rank_wait_timeout"])}, in seconds)': True,
        f'`vllm_server_stall_timeout` (default {_num(sync["vllm_server_stall_timeout"])}, in seconds; 0 off)': True,
        f'`routing_replay_min_agreement` ({_num(sync["routing_replay_min_agreement"])})': True,
        f'`clip_band_target` ({_num(sync["clip_band_target"])})': True,
        f'`[clip_band_min, clip_band_max]` ({_num(sync["clip_band_min"])}, {_num(sync["clip_band_max"])})': True,
        f'(`exact_lora_merge={sync["exact_lora_merge"]}`)': asynchronous["exact_lora_merge"] is True,
        f'(`merge_adapters_for_rollout={sync["merge_adapters_for_rollout"]}`': True,
        f'the band defaults to `clip_band="{asynchronous["ASYNC_DEFAULT_CLIP_BAND"]}"`, starting at the paper\'s '
        f'{_num(sync["PAPER_EPSILON_LOW"])} / {_num(sync["PAPER_EPSILON_HIGH"])}': asynchronous["clip_band"] is None,
    }
    for statement, holds in stated.items():
        assert holds and statement in text, f"CHANGELOG.md should say, as the code does: {statement}"
