"""The ends of pyproject.toml's dependency ranges, as released on the package index pip is configured with.

    python .ci/ranges.py oldest|newest      one `name==version` per line: the lowest / highest release each range admits
    python .ci/ranges.py oldest|newest --not-installed      only the pins this environment does not have
    python .ci/ranges.py table              name, range, oldest, newest, installed (for the CI log)

Covers the small wheels CI can install in minutes (torch is covered elsewhere: .ci/compat's header). Read-only.
"""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PACKAGES = ("trl", "transformers", "accelerate", "peft", "datasets", "tokenizers", "safetensors", "deepspeed")


def ranges() -> dict[str, Requirement]:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    return {name: next(r for r in requirements if r.name == name) for name in PACKAGES}


def released(name: str) -> list[Version]:
    output = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True,
                            text=True, check=True).stdout
    listed = re.search(r"Available versions: (.*)", output).group(1)
    return [Version(v) for v in listed.split(", ")]


def admitted(requirement: Requirement) -> list[Version]:
    found = sorted(v for v in released(requirement.name) if not v.is_prerelease and v in requirement.specifier)
    if not found:
        raise SystemExit(f"ranges: no release of {requirement.name} on the index is inside {requirement.specifier}")
    return found


def installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def main(what: str, not_installed: bool = False) -> None:
    for name, requirement in ranges().items():
        versions = admitted(requirement)
        if what in ("oldest", "newest"):
            version = versions[0] if what == "oldest" else versions[-1]
            if not (not_installed and installed(name) == str(version)):
                print(f"{name}=={version}")
        else:
            print(f"{name:13} {str(requirement.specifier):16} oldest {str(versions[0]):8} newest "
                  f"{str(versions[-1]):8} installed {installed(name)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "table", "--not-installed" in sys.argv[2:])
