"""Report ``XIDFLOW_*`` variables that nothing reads, with the closest name that is read.

pydantic-settings ignores unknown variables (``extra="ignore"``), so a typo such as
``XIDFLOW_AGG_WINDOW_SECONDS`` would silently leave the default in place. The known names are
collected from every settings class (``pipeline.runtime.configdoc.SETTINGS_CLASSES``, plus any other
settings class already imported) and the few variables read directly from the environment. Modules
not yet imported are read as source (``ast``), so the check costs no Faust import; a unit test keeps
that reading equal to pydantic's.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PREFIX = "XIDFLOW_"

# Read with os.environ directly (not through a settings class).
DIRECT_NAMES = frozenset({
    "XIDFLOW_METRICS_PORT",  # pipeline.runtime.metrics
    "XIDFLOW_METRICS_ADDR",  # pipeline.runtime.metrics
    "XIDFLOW_METRICS_REFRESH_S",  # pipeline.runtime.metrics
    "XIDFLOW_STATE_DIR",  # pipeline.localinfra.launcher
    "XIDFLOW_NO_DOCKER",  # pipeline.localinfra.launcher
    "XIDFLOW_CACHE_DIR",  # pipeline.localinfra.install
    "XIDFLOW_GPU_PCI",  # set by the actuator in reset Jobs
    "XIDFLOW_TEST_WORKER_LOGLEVEL",  # the test suite
    "XIDFLOW_START_TIMELINE",  # pipeline.runtime.startmarks (set by xidflow bench)
    "XIDFLOW_BENCH_PYTHON",  # pipeline.benchmarks.burst_world (the interpreter of the measured processes)
    "XIDFLOW_BENCH_PROFILE_DIR",  # pipeline.benchmarks.scale (py-spy profiles of the actuators)
})


def settings_names(cls: type) -> set[str]:
    """Environment variable names of one pydantic-settings class (prefix + field, or its alias)."""
    prefix = (getattr(cls, "model_config", {}).get("env_prefix") or "").upper()
    names = set()
    for name, field in getattr(cls, "model_fields", {}).items():
        alias = field.validation_alias
        names.add(alias.upper() if isinstance(alias, str) else (prefix + name).upper())
    return names


def _source_names(module_name: str, class_name: str) -> set[str] | None:
    """The class's variable names read from its module's source, without importing it (the worker's and
    the actuator's modules import Faust and the Kubernetes client: seconds). None when not found there."""
    # The file is found from the top-level package's location: find_spec on a dotted name would import
    # its parent packages, and a package's __init__ may import the heavy modules this avoids.
    top, _, rest = module_name.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest.split(".")) if rest else None
    source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None) if base else None
    if source is None:
        return None
    tree = ast.parse(source.read_text())
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None or len(cls.bases) != 1 or getattr(cls.bases[0], "id", None) != "BaseSettings":
        return None  # inherits fields from elsewhere: let pydantic answer
    prefix, names = "", set()
    for node in cls.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["model_config"]:
            prefix = next((k.value.value for k in getattr(node.value, "keywords", [])
                           if k.arg == "env_prefix" and isinstance(k.value, ast.Constant)), "")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id.startswith("_") or "ClassVar" in ast.unparse(node.annotation):
                continue
            alias = next((k.value.value for k in getattr(node.value, "keywords", [])
                          if k.arg == "validation_alias" and isinstance(k.value, ast.Constant)), None)
            names.add(str(alias).upper() if alias else (str(prefix) + node.target.id).upper())
    return names


def _registered() -> Iterable[tuple[str, str]]:
    from pipeline.runtime import configdoc
    for module_name, class_name, _ in configdoc.SETTINGS_CLASSES:
        yield module_name, class_name


def known_names(imported: bool = False) -> set[str]:
    """Every ``XIDFLOW_*`` name a setting reads. ``imported=True`` asks pydantic (imports every module)."""
    from pydantic_settings import BaseSettings

    names = set(DIRECT_NAMES)
    for module_name, class_name in _registered():
        module = sys.modules.get(module_name)
        from_source = None if imported or module is not None else _source_names(module_name, class_name)
        if from_source is not None:
            names |= from_source
            continue
        try:
            cls = getattr(module or importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # a module missing from this build is not this check's business
        names |= settings_names(cls)
    stack = list(BaseSettings.__subclasses__())  # settings classes already imported, registered or not
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        names |= settings_names(cls)
    return {n for n in names if n.startswith(PREFIX)}


def unknown(environ: Mapping[str, str], known: set[str]) -> list[tuple[str, str | None]]:
    """(unknown variable, closest known name or None), sorted. Pure."""
    out = []
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in known):
        out.append((name, closest(name, known)))
    return out


def closest(name: str, known: set[str]) -> str | None:
    """The closest known name, preferring the same group (``XIDFLOW_AGG_...`` for ``XIDFLOW_AGG_...``)."""
    group = name[len(PREFIX):].split("_", 1)[0]
    same = sorted(n for n in known if n[len(PREFIX):].split("_", 1)[0] == group)
    close = difflib.get_close_matches(name, same, n=1, cutoff=0.5) or difflib.get_close_matches(
        name, sorted(known), n=1, cutoff=0.6
    )
    return close[0] if close else None


def warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per unknown ``XIDFLOW_*`` variable. Imports the settings classes only when one is set."""
    env = os.environ if environ is None else environ
    if not any(n.startswith(PREFIX) for n in env):
        return []  # nothing to check: `xidflow classify` on a laptop pays nothing
    return [
        f"warning: {name} is set but no xidflow setting has that name; "
        + (f"did you mean {close}?" if close else "see docs/configuration.md.")
        for name, close in unknown(env, known_names())
    ]
