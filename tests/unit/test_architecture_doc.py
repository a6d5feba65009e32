"""docs/architecture.md names the package and modules of every stage: each path it names must exist.

A file moved or renamed without the page following it fails here, with the path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
CODE = re.compile(r"`([^`\s]+)`")
PATHISH = re.compile(r"^[\w.-]+(/[\w.-]*)+$|^[\w-]+\.(py|md|yaml|toml|lock)$")


def named_paths() -> list[str]:
    return sorted({m for m in CODE.findall(DOC.read_text()) if PATHISH.match(m)})


def test_the_architecture_page_names_real_paths() -> None:
    paths = named_paths()
    assert len(paths) > 30, paths  # the page names each stage's package and modules
    assert not [p for p in paths if not (ROOT / p).exists()]


def test_every_stage_package_is_on_the_page() -> None:
    # A new package under pipeline/ is a new room of the house: the page says where it stands in the flow.
    packages = sorted(
        f"pipeline/{p.name}/" for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").exists()
    )
    text = DOC.read_text()
    assert not [p for p in packages if p not in text]
