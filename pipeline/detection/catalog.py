"""The fault catalog: what each Xid / SXid / signal means and what we do about it.

The tables live in ``pipeline/data/xid_catalog.yaml`` (reviewable, with its sources). This module
loads and validates them, merges operator overrides, and answers the lookups classification needs.

Operator overrides
------------------
Any entry can be overridden from a YAML file with the same layout; only the fields given change::

    # /etc/xidflow/catalog-overrides.yaml
    xid:
      13: {action: RESET_GPU, note: "our fleet: Xid 13 has always been hardware"}
      200: {name: NEW_CODE, action: IGNORE, severity: info}    # new codes may be added
    sxid:
      20009: {fatal: false, action: IGNORE, severity: warning}
    signals:
      pod_hardware: {action: RESET_GPU}

Point ``XIDFLOW_CATALOG_OVERRIDES`` at the file (see :class:`CatalogSettings`) or pass
``overrides=`` to :meth:`Catalog.load`. Invalid entries fail loudly with the entry named
(``CatalogError: xid 13: action: Input should be 'IGNORE', ...``).

Lookups (all return a :class:`Classification`, never raise):
:meth:`Catalog.xid`, :meth:`Catalog.sxid`, :meth:`Catalog.recovery_action`, :meth:`Catalog.nvlink5`,
:meth:`Catalog.signal`, :meth:`Catalog.health_check`; :meth:`Catalog.scope` says whether a fault takes out one GPU
or the whole node (the ``scope`` column, default ``defaults.scope``: node).

The catalog is the single source of truth for an Xid's behaviour: besides the action it says which
codes are sticky (the aggregator escalates their repeats), which follow a decision flow (``workflow``:
Xid 45 follows other Xids, 79 is the lost-GPU group, 13/31 escalate on repeats, 144-150 and 154 read
their action from the line) and which node condition describes a fault (``problem``). The detector,
the aggregator, the parse stage's health-check events and the actuator's problem mapping all ask it.

Unknown and unbucketed codes
----------------------------
A code missing from the tables, or one NVIDIA lists without an immediate-resolution bucket, gets
``defaults.unknown_xid``: ``ALERT`` (a Warning Event and a node condition, no quarantine), so that a
new driver's new code is seen by a person without taking nodes out of service (the failure NVSentinel
issue 1888 describes). Operators who prefer the old conservative answer override it::

    defaults:
      unknown_xid: {action: CONTACT_SUPPORT, severity: error}

Which catalog a process uses: :meth:`Catalog.configured` (built-in file plus the environment's
overrides, loaded once per environment value) is the default of every classifying component.

One module (about 470 lines) on purpose: loading, validating, merging overrides and looking up the one
catalog are one concept; most of the length is validation that names the file and the entry at fault.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.records import Action, Severity

DEFAULT_CATALOG_PATH = Path(str(resources.files("pipeline") / "data" / "xid_catalog.yaml"))


class CatalogError(ValueError):
    """The catalog (or an override file) is invalid; the message names the entry."""


class CatalogSettings(BaseSettings):
    """Where operator overrides come from: ``XIDFLOW_CATALOG_OVERRIDES=/path/to/overrides.yaml``."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_CATALOG_", extra="ignore")

    path: Path | None = Field(default=None, description="Replace the built-in catalog file entirely")
    overrides: Path | None = Field(
        default=None,
        description="YAML file whose entries override the catalog's (same layout). Read by every stage that "
        "classifies: the worker's parse stage and aggregation, the actuator's condition types and policy "
        "matching, `xidflow classify`. Example: `defaults: {unknown_xid: {action: CONTACT_SUPPORT}}` "
        "quarantines on unknown codes instead of alerting.",
    )


@dataclass(frozen=True, slots=True)
class Classification:
    """The catalog's verdict on one signal."""

    action: Action
    severity: Severity
    sticky: bool = False
    name: str = ""
    fatal: bool | None = None
    known: bool = True
    workflow: str = ""

    @property
    def quarantine(self) -> bool:
        return self.action.quarantines


Workflow = Literal["", "follower", "gpu_lost", "nvlink5", "recovery_action", "repeat_gpc_tpc", "repeat_gpu"]
"""How a code's events are treated beyond its action (see the catalog file's header)."""

Problem = Literal["xid", "ecc", "nvlink", "count", "sxid", "fell_off_bus"]
"""Which node condition class describes a fault (the actuator's condition type derives from it):
``fell_off_bus`` is ``GpuFellOffBus`` (Xid 79 and the Xid-less fallen-off-bus lines), ``count`` a GPU
missing for another reason (``GpuCount``)."""

Scope = Literal["gpu", "node"]
"""What a fault takes out: ``gpu`` one device (per-GPU quarantine may taint just it), ``node`` the node."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = ""
    description: str = ""
    bucket: str = ""
    action: Action
    severity: Severity
    sticky: bool = False
    workflow: Workflow = ""
    problem: Problem | None = None
    xid: int | None = Field(default=None, description="Signals: the Xid code this signal is the same fault as")
    scope: Scope | None = Field(default=None, description="gpu | node; unset: defaults.scope")
    cancels: tuple[int, ...] = Field(
        default=(), description="Xid codes whose open incident on the same GPU this code closes (NVIDIA's catalog)"
    )
    source: str = ""
    note: str = ""


class _SXidEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = ""
    fatal: bool
    fabric: bool = False
    action: Action
    severity: Severity
    note: str = ""
    scope: Scope | None = None


class _Defaults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    unknown_xid: _Entry
    unknown_sxid: _Entry
    unknown_sxid_fatal: _Entry | None = None
    unknown_sxid_nonfatal: _Entry | None = None
    unknown_recovery_action: _Entry
    scope: Scope = "node"
    """Scope of every row that names none (and of unknown codes): the whole node, the conservative answer."""


class _Nvlink5(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fatal: _Entry
    nonfatal: _Entry
    subcodes: dict[int, dict[int, _Entry]] = Field(
        default_factory=dict, description="code -> subcode (intrInfo bits 20-25) -> entry; wins over the flag"
    )


_REQUIRED_SIGNALS = (
    "gpu_fallen_off_bus",
    "nccl_segfault",
    "pod_hardware",
    "pod_application",
    "pod_sympathetic",
)


def _validate(section: str, key: object, model: type[BaseModel], value: Any) -> Any:
    if not isinstance(value, dict):
        raise CatalogError(f"{section} {key}: expected a mapping, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(entry)'}: {err['msg']}" for err in exc.errors()
        )
        raise CatalogError(f"{section} {key}: {problems}") from None


def _int_key(section: str, key: object) -> int:
    try:
        code = int(str(key))
    except ValueError:
        raise CatalogError(f"{section} {key!r}: the key must be an integer code") from None
    if code < 0:
        raise CatalogError(f"{section} {key}: codes are non-negative")
    return code


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Section-wise, entry-wise, field-wise merge of an override document onto the catalog."""
    merged = copy.deepcopy(base)
    for section, entries in override.items():
        if section == "version":
            continue
        if not isinstance(entries, dict):
            raise CatalogError(f"override section {section!r}: expected a mapping")
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            raise CatalogError(f"override section {section!r}: the catalog's section is not a mapping")
        # YAML may give int keys in one document and str keys in the other: match by string.
        by_str = {str(k): k for k in target}
        for key, fields in entries.items():
            existing_key = by_str.get(str(key), key)
            current = target.get(existing_key)
            if isinstance(current, dict) and isinstance(fields, dict):
                target[existing_key] = {**current, **fields}
            else:
                target[existing_key] = fields
    return merged


class Catalog:
    """Validated, immutable fault tables with conservative answers for anything unknown."""

    def __init__(self, document: dict[str, Any]) -> None:
        if not isinstance(document, dict):
            raise CatalogError("catalog: the document must be a mapping")
        for section in ("defaults", "xid", "sxid", "recovery_actions", "nvlink5", "signals", "health_checks"):
            if not isinstance(document.get(section), dict):
                raise CatalogError(f"catalog: section {section!r} is missing or not a mapping")
        self._defaults: _Defaults = _validate("defaults", "", _Defaults, document["defaults"])
        self._xid: dict[int, _Entry] = {
            _int_key("xid", k): _validate("xid", k, _Entry, v) for k, v in document["xid"].items()
        }
        self._sxid: dict[int, _SXidEntry] = {
            _int_key("sxid", k): _validate("sxid", k, _SXidEntry, v) for k, v in document["sxid"].items()
        }
        self._recovery: dict[int, _Entry] = {
            _int_key("recovery_actions", k): _validate("recovery_actions", k, _Entry, v)
            for k, v in document["recovery_actions"].items()
        }
        self._nvlink5: _Nvlink5 = _validate("nvlink5", "", _Nvlink5, document["nvlink5"])
        self._signals: dict[str, _Entry] = {
            str(k): _validate("signals", k, _Entry, v) for k, v in document["signals"].items()
        }
        missing = [s for s in _REQUIRED_SIGNALS if s not in self._signals]
        if missing:
            raise CatalogError(f"signals: missing required entries {missing}")
        self._health: dict[str, _Entry] = {
            str(k): _validate("health_checks", k, _Entry, v) for k, v in document["health_checks"].items()
        }
        if "unknown" not in self._health:
            raise CatalogError("health_checks: missing required entry 'unknown'")
        # Lookups on the hot path return prebuilt objects instead of constructing one per event.
        self._xid_cls = {code: self._cls(e) for code, e in self._xid.items()}
        self._cancels = {code: frozenset(e.cancels) for code, e in self._xid.items() if e.cancels}

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: str | Path | dict[str, Any] | None = None,
        *,
        path_name: str = "catalog file",
        overrides_name: str = "catalog override file",
    ) -> Catalog:
        """Load the catalog file (default: the built-in one) and apply overrides (file or mapping).

        ``path_name``/``overrides_name``: how errors name the files (``from_settings``: the variables)."""
        document = _read_yaml(Path(path), path_name) if path else _read_yaml(DEFAULT_CATALOG_PATH)
        if overrides is not None:
            override_doc = overrides if isinstance(overrides, dict) else _read_yaml(Path(overrides), overrides_name)
            document = _merge(document, override_doc)
        return cls(document)

    @classmethod
    def from_settings(cls, settings: CatalogSettings | None = None) -> Catalog:
        """The catalog as configured by the environment (``XIDFLOW_CATALOG_PATH`` / ``_OVERRIDES``)."""
        settings = settings or CatalogSettings()
        return cls.load(settings.path, settings.overrides, path_name="XIDFLOW_CATALOG_PATH",
                        overrides_name="XIDFLOW_CATALOG_OVERRIDES")

    @classmethod
    def default(cls) -> Catalog:
        """The built-in catalog, loaded once per process."""
        return _default_catalog()

    @classmethod
    def configured(cls) -> Catalog:
        """The catalog as this process's environment configures it, loaded once per environment value.

        The built-in file (or ``XIDFLOW_CATALOG_PATH``) with ``XIDFLOW_CATALOG_OVERRIDES`` applied: the
        default of every component that classifies (detector, aggregator, actuator problem mapping,
        ``xidflow classify``), so an operator's override reaches all of them. Cached per settings value;
        raises :class:`CatalogError` for an invalid override (not cached: a fixed file is read again).
        """
        # A cheap key (two environment reads); the settings are parsed only when it changes.
        return _configured_catalog(os.environ.get("XIDFLOW_CATALOG_PATH"), os.environ.get("XIDFLOW_CATALOG_OVERRIDES"))

    # -- lookups ----------------------------------------------------------------------------------

    @staticmethod
    def _cls(
        entry: _Entry, *, known: bool = True, fatal: bool | None = None, name: str | None = None
    ) -> Classification:
        return Classification(
            action=entry.action,
            severity=entry.severity,
            sticky=entry.sticky,
            name=entry.name if name is None else name,
            fatal=fatal,
            known=known,
            workflow=entry.workflow,
        )

    def workflow(self, code: int | None) -> str:
        """The decision flow of Xid ``code`` (``""`` when its action alone decides)."""
        entry = self._xid.get(code) if code is not None else None
        return entry.workflow if entry is not None else ""

    def cancels(self, code: int | None) -> frozenset[int]:
        """Xid codes whose open incident Xid ``code`` closes (the row's ``cancels``: NVIDIA says the later code
        ends the earlier one's condition); empty for most codes."""
        return self._cancels.get(code, frozenset()) if code is not None else frozenset()

    def codes_with_workflow(self, workflow: str) -> frozenset[int]:
        return frozenset(code for code, entry in self._xid.items() if entry.workflow == workflow)

    def sticky_codes(self) -> frozenset[int]:
        """Xid codes whose repeats on one GPU point to hardware."""
        return frozenset(code for code, entry in self._xid.items() if entry.sticky)

    def problem(self, kind: str, code: int | None) -> str:
        """The condition class of a fault: the Xid row's ``problem`` (default ``xid``), a signal's own."""
        if kind == "xid":
            entry = self._xid.get(code) if code is not None else None
            return (entry.problem if entry is not None else None) or "xid"
        if kind == "sxid":
            return "sxid"
        if kind == "health_check":
            return "xid"
        entry = self._signals.get(kind)
        if entry is not None and entry.problem:
            return entry.problem
        return "xid"

    def scope(self, kind: str, code: int | None = None) -> Scope:
        """What the fault takes out: ``gpu`` (one device) or ``node``, from the row's ``scope`` column.

        Xid and SXid rows by code, signals by kind, failed node checks by check name (pass it as
        ``code``-less ``kind="health_check:<check>"``); a row without ``scope`` and anything unknown get
        ``defaults.scope``.
        """
        entry: _Entry | _SXidEntry | None
        if kind == "xid":
            entry = self._xid.get(code) if code is not None else None
        elif kind == "sxid":
            entry = self._sxid.get(code) if code is not None else None
        elif kind.startswith("health_check:"):
            entry = self._health.get(kind.split(":", 1)[1])
        else:
            entry = self._signals.get(kind)
        return (entry.scope if entry is not None else None) or self._defaults.scope

    def health_problem(self, check: str) -> str:
        """The condition class of a failed node check (``gpu_count`` -> count, ``nvlink`` -> nvlink, ...)."""
        entry = self._health.get(check)
        return (entry.problem if entry is not None else None) or "xid"

    def signal_xid(self, name: str) -> int | None:
        """The Xid a code-less signal is the same fault as (``gpu_fallen_off_bus`` -> 79), if any."""
        entry = self._signals.get(name)
        return entry.xid if entry is not None else None

    def xid(self, code: int) -> Classification:
        """Classification of Xid ``code``; unknown codes get ``defaults.unknown_xid``."""
        found = self._xid_cls.get(code)
        if found is not None:
            return found
        return self._cls(self._defaults.unknown_xid, known=False, name=f"XID_{code}")

    def xid_entry(self, code: int) -> dict[str, Any] | None:
        """The full catalog row (name, description, bucket, note, ...) for display, or None."""
        entry = self._xid.get(code)
        return entry.model_dump(mode="json") if entry else None

    def xid_codes(self) -> list[int]:
        return sorted(self._xid)

    def sxid(self, code: int, printed_fatal: bool | None = None) -> Classification:
        """Classification of NVSwitch SXid ``code``.

        ``printed_fatal`` is the Fatal/Non-fatal word printed in the line. A printed "Fatal" always
        wins over a non-fatal catalog row (escalating to at least RESET_GPU). For a code outside the
        Fabric Manager tables the printed word decides: ``defaults.unknown_sxid_fatal`` or
        ``defaults.unknown_sxid_nonfatal`` (non-fatal SXids are informational), and
        ``defaults.unknown_sxid`` when the line prints neither.
        """
        entry = self._sxid.get(code)
        if entry is None:
            d = self._defaults.unknown_sxid
            if printed_fatal is True and self._defaults.unknown_sxid_fatal is not None:
                d = self._defaults.unknown_sxid_fatal
            elif printed_fatal is False and self._defaults.unknown_sxid_nonfatal is not None:
                d = self._defaults.unknown_sxid_nonfatal
            return Classification(d.action, d.severity, False, f"SXID_{code}", printed_fatal, known=False)
        fatal = entry.fatal or bool(printed_fatal)
        action, severity = entry.action, entry.severity
        if fatal and not entry.fatal:
            action = Action.most_severe(action, Action.RESET_GPU)
            severity = max(severity, Severity.ERROR, key=lambda s: s.rank)
        return Classification(action, severity, False, entry.name or f"SXID_{code}", fatal)

    def sxid_codes(self) -> list[int]:
        return sorted(self._sxid)

    def recovery_action(self, number: int) -> Classification:
        """Xid 154: classification of GPU recovery action ``number`` (the 0xN in the line)."""
        entry = self._recovery.get(number)
        if entry is None:
            unknown = self._defaults.unknown_recovery_action
            return self._cls(unknown, known=False, name=f"RECOVERY_ACTION_{number}")
        return self._cls(entry, name=f"GPU_RECOVERY_ACTION_{entry.name}")

    def nvlink5(self, code: int, fatal: bool | None, subcode: int | None = None) -> Classification:
        """NVLink5 Xids 144-150: the decode table's row for ``subcode`` when there is one, else the
        printed Fatal/Nonfatal flag; no flag falls back to the code's own row."""
        base = self.xid(code)
        rows = self._nvlink5.subcodes.get(code)
        row = rows.get(subcode) if rows is not None and subcode is not None else None
        if row is not None:
            name = row.name or f"{base.name}_{subcode}"
            return Classification(row.action, row.severity, row.sticky or base.sticky, name, fatal, base.known,
                                  base.workflow)
        if fatal is None:
            return base
        entry = self._nvlink5.fatal if fatal else self._nvlink5.nonfatal
        return Classification(entry.action, entry.severity, base.sticky, base.name, fatal, base.known, base.workflow)

    def signal(self, name: str) -> Classification:
        """A named non-code signal (``gpu_fallen_off_bus``, ``nccl_segfault``, ``pod_<grade>``)."""
        entry = self._signals.get(name)
        if entry is None:
            return self._cls(self._defaults.unknown_xid, known=False, name=name.upper())
        return self._cls(entry)

    def health_check(self, check: str, values: dict[str, Any] | None = None) -> Classification:
        """A failed probe check by its name; ``remapped_rows`` with ``values.failed`` is worse."""
        if check == "remapped_rows" and values and values.get("failed") and "remapped_rows_failed" in self._health:
            return self._cls(self._health["remapped_rows_failed"])
        entry = self._health.get(check)
        if entry is None:
            return self._cls(self._health["unknown"], known=False)
        return self._cls(entry)


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path, what: str = "catalog file") -> dict[str, Any]:
    """``what``: how errors name the file (the setting that named it, where one did)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{what} {path}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    try:
        # libyaml's safe loader where it is built in: the pure-Python one spent ~0.15 s of CPU on the bundled
        # catalog at every worker and actuator start, on the critical path of a restarted process.
        document = yaml.load(text, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader either way
    except yaml.YAMLError as exc:
        raise CatalogError(f"{what} {path}: not valid YAML: {exc}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise CatalogError(f"{what} {path}: the top level must be a mapping")
    return document


@lru_cache(maxsize=1)
def _default_catalog() -> Catalog:
    return Catalog.load()


@lru_cache(maxsize=8)
def _configured_catalog(path_env: str | None, overrides_env: str | None) -> Catalog:
    # Keyed by the environment, so a process (or a test) that changes it gets the matching catalog.
    settings = CatalogSettings()
    if settings.path is None and settings.overrides is None:
        return _default_catalog()
    return Catalog.from_settings(settings)
