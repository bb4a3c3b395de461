"""Every dotted `trl_gspo.` name the docs write (README.md, docs/*.md, recipes/**/*.yaml) names something that exists:
the longest importable module prefix imports, and the rest resolves attribute by attribute. A function moved to
another module, with the docs left naming the old place, fails here with the page and the name."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLACES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").rglob("*.yaml"))]
# A dotted name: `trl_gspo` followed by one or more `.identifier`; a path (`trl_gspo/x.py`) has no dot after the
# package name and is not matched; a sentence's closing period is not followed by an identifier.
NAME = re.compile(r"(?<![\w./-])trl_gspo(?:\.[A-Za-z_]\w*)+")


def _names() -> list[tuple[str, str]]:
    found = {(str(path.relative_to(ROOT)), match.group(0)) for path in PLACES
             for match in NAME.finditer(path.read_text())}
    return sorted(found)


def _resolve(dotted: str):
    """Import the longest prefix of `dotted` that is a module, then getattr the remaining parts."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            value = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name or module_name.startswith(f"{error.name}."):
                continue  # no such module: try a shorter prefix
            raise  # the module exists but one of its own imports is missing: a real failure
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(dotted)


NAMES = _names()


def test_the_docs_name_enough_to_check():
    assert len(NAMES) >= 40, NAMES  # the pattern still matches the docs


@pytest.mark.parametrize(("page", "name"), NAMES, ids=[f"{page}:{name}" for page, name in NAMES])
def test_every_dotted_name_in_the_docs_resolves(page, name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{page}: `{name}` does not resolve ({type(error).__name__}: {error})")
