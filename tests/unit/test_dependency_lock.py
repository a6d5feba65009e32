"""requirements.lock is what `make setup` installs, and it agrees with pyproject.toml.

A dependency added or narrowed in pyproject.toml without `make lock` fails here, before a fresh machine
installs something CI never ran; so does an environment that is not the lock's (run `make setup`).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()


def _locked() -> dict[str, tuple[Requirement, list[str]]]:
    """Each locked package: its pin (with its environment marker) and its hashes."""
    entries: dict[str, tuple[Requirement, list[str]]] = {}
    current: str | None = None
    for line in LOCK.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            req = Requirement(line.rstrip(" \\"))
            current = canonicalize_name(req.name)
            entries[current] = (req, [])
        elif current and (m := re.search(r"--hash=(sha256:[0-9a-f]{64})", line)):
            entries[current][1].append(m.group(1))
    return entries


def _declared() -> list[Requirement]:
    project = PYPROJECT["project"]
    build = PYPROJECT["build-system"]["requires"]
    return [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["test"], *build)]


def test_every_locked_package_is_pinned_exactly_with_hashes() -> None:
    locked = _locked()
    assert len(locked) > 20
    for name, (req, hashes) in locked.items():
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{name} is not pinned exactly: {req}"
        assert hashes, f"{name} has no hash in {LOCK.name}"


def test_every_declared_dependency_is_locked_within_its_range() -> None:
    locked = _locked()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} (pyproject.toml) is not in {LOCK.name}: run `make lock`"
        pinned = next(iter(locked[name][0].specifier)).version
        assert req.specifier.contains(pinned, prereleases=True), (
            f"{LOCK.name} pins {name}=={pinned}, outside pyproject.toml's {req}: run `make lock`")


def test_the_private_internals_we_patch_are_held_to_one_minor_release() -> None:
    # fetch_watchdog, undecodable and group_membership patch or read their internals (see
    # tests/integration/test_upstream_internals.py): a new minor release must be a deliberate upgrade.
    for req in _declared():
        if canonicalize_name(req.name) in {"faust-streaming", "mode-streaming", "aiokafka"}:
            upper = [s for s in req.specifier if s.operator == "<"]
            assert upper, f"{req} has no upper bound"


def test_this_environment_is_the_lock() -> None:
    stale = []
    for name, (req, _) in _locked().items():
        if req.marker is not None and not req.marker.evaluate():
            continue  # another platform's package
        pinned = next(iter(req.specifier)).version
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != pinned:
            stale.append(f"{name}: locked {pinned}, installed {installed}")
    assert stale == [], f"the environment is not {LOCK.name} (run `make setup`): {stale}"


def test_make_setup_installs_the_lock_with_hashes_and_reinstalls_when_it_changes() -> None:
    stamp = re.search(r"^\$\(STAMP\):(.*)$", MAKEFILE, re.M)
    assert stamp and "$(LOCK)" in stamp.group(1)
    assert re.search(r"^LOCK\s*:=\s*requirements\.lock$", MAKEFILE, re.M)
    assert "--require-hashes -r $(LOCK)" in MAKEFILE
    assert "--no-deps" in MAKEFILE  # the project itself adds nothing unlocked
