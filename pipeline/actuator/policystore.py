"""Where the policies come from: RescuePolicy/WarmStandbyPolicy CRDs when installed, else a YAML file.

With CRDs the store lists the objects and then WATCHES them, so an edit is in force within moments,
not at the next poll; the watch ends every ``policy_refresh_seconds`` and the store lists again (a
resync that repairs anything a broken watch missed).

Each object is validated on its own and against the others (rule names are unique across policies).
An update that fails xidflow's checks does not fall back to the global default: the LAST VALID
version of that object stays in force. The outcome is written to the object's status
(``observedGeneration``, ``inForceGeneration`` and an ``Accepted`` condition) and an invalid
generation gets one Warning Event on the object, so ``kubectl describe`` shows why it was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.actuator.effects import EVENT_NAMESPACE, create_event_once
from pipeline.actuator.kube import Forbidden, Kube, KubeError, KubeUnavailable, NotFound, unreachable
from pipeline.actuator.policy import (
    API_GROUP,
    API_VERSION,
    RESCUE_KIND,
    RESCUE_PLURAL,
    STANDBY_KIND,
    STANDBY_PLURAL,
    PolicyError,
    PolicySet,
    build_policy_set,
    load_yaml_file,
    parse_document,
)
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import stable_id

log = logging.getLogger("xidflow.actuator.policy")

PLURALS: dict[str, str] = {RESCUE_PLURAL: RESCUE_KIND, STANDBY_PLURAL: STANDBY_KIND}
ACCEPTED = "Accepted"

Key = tuple[str, str]  # (plural, name)


@dataclass
class Tracked:
    """One policy object: the version seen last, the last valid version (in force), and why not the latest."""

    doc: dict[str, Any]
    valid: dict[str, Any] | None = None
    error: str | None = None

    @property
    def generation(self) -> int:
        return int((self.doc.get("metadata") or {}).get("generation") or 0)

    @property
    def valid_generation(self) -> int | None:
        if self.valid is None:
            return None
        return int((self.valid.get("metadata") or {}).get("generation") or 0)


def desired_status(tracked: Tracked) -> dict[str, Any]:
    """The status xidflow reports for an object (without timestamps)."""
    generation, in_force = tracked.generation, tracked.valid_generation
    if tracked.error is None:
        condition = {"status": "True", "reason": "Valid", "message": "in force"}
    else:
        kept = (
            f"generation {in_force} stays in force" if in_force is not None else "no valid version; not in force"
        )
        condition = {"status": "False", "reason": "InvalidPolicy", "message": f"{tracked.error}; {kept}"[:2048]}
    return {
        "observedGeneration": generation,
        "inForceGeneration": in_force,
        # The version in force is kept on the object itself, so a restarted replica keeps it in force too.
        # As JSON text: a merge patch then replaces it whole instead of merging old label maps into it.
        "inForceSpec": _json(tracked.valid.get("spec")) if tracked.valid is not None else None,
        "conditions": [{"type": ACCEPTED, "observedGeneration": generation, **condition}],
    }


def version_in_force_from_status(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The object as it was when last accepted (from ``status.inForceSpec``), when its status records one."""
    status = doc.get("status") or {}
    text, generation = status.get("inForceSpec"), status.get("inForceGeneration")
    if not isinstance(text, str) or generation is None:
        return None
    try:
        spec = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(spec, Mapping):
        return None
    meta = {**(doc.get("metadata") or {}), "generation": generation}
    return {**doc, "metadata": meta, "spec": dict(spec)}


def status_matches(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether the object's status already says what ``desired`` says (timestamps ignored)."""
    current = current or {}
    if current.get("observedGeneration") != desired["observedGeneration"]:
        return False
    if current.get("inForceGeneration") != desired["inForceGeneration"]:
        return False
    if current.get("inForceSpec") != desired["inForceSpec"]:
        return False
    want = desired["conditions"][0]
    have = next((c for c in current.get("conditions") or [] if c.get("type") == ACCEPTED), None)
    return have is not None and all(have.get(k) == v for k, v in want.items())


class PolicyStore:
    """Holds the current PolicySet, kept up to date by list + watch (CRDs) or loaded from a file."""

    def __init__(self, kube: Kube | None, settings: ActuatorSettings, initial: PolicySet | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.current = initial or PolicySet()
        self.source = "built-in" if initial is None else "given"
        self.errors: list[str] = []
        self._loaded_at = 0.0
        self._tracked: dict[Key, Tracked] = {}
        self._versions: dict[str, str | None] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._watch_wanted = False
        self._status_forbidden_logged = False
        self.changed = asyncio.Event()
        """Set whenever the policies in force may have changed (tests and tools wait on it)."""

    async def _use_crds(self) -> bool:
        if self.settings.policy_source == "file":
            return False
        if self.settings.policy_source == "crd":
            return True
        assert self.kube is not None
        return await self.kube.crd_installed(f"{RESCUE_PLURAL}.{API_GROUP}")

    # -- loading ------------------------------------------------------------------------------------------
    async def refresh(self) -> PolicySet:
        """List every policy object now. Invalid ones are reported (``errors``, status, Event); their last
        valid version, when there is one, stays in force."""
        if self.kube is not None and await self._use_crds():
            for plural in PLURALS:
                await self._list(plural)
            self.source = "crd"
        elif self.settings.policy_file:
            self.current = load_yaml_file(self.settings.policy_file)
            self.source = f"file:{self.settings.policy_file}"
        self._loaded_at = time.monotonic()
        return self.current

    async def maybe_refresh(self) -> PolicySet:
        """The policies in force; without a running watch they are re-listed every ``policy_refresh_seconds``."""
        if self.watching:
            return self.current
        if time.monotonic() - self._loaded_at >= self.settings.policy_refresh_seconds:
            try:
                await self.refresh()
                if self._watch_wanted:
                    self.start_watching()  # the CRDs were installed since the start (policySource: auto)
            except Exception as exc:  # keep acting on the last good policies
                if not unreachable(exc):  # an outage is logged once, as such (reachability.API_SERVER)
                    log.exception("policy refresh failed; keeping the previous policies")
                self._loaded_at = time.monotonic()
        return self.current

    async def _list(self, plural: str) -> None:
        assert self.kube is not None
        page = await self.kube.list_cluster_objects_page(
            API_GROUP, API_VERSION, plural, self.settings.policy_label_selector
        )
        self._versions[plural] = (page.get("metadata") or {}).get("resourceVersion")
        items = sorted(page.get("items") or [], key=_age_order)
        seen = {(plural, _name(doc)) for doc in items}
        for key in [k for k in self._tracked if k[0] == plural and k not in seen]:
            del self._tracked[key]
        for doc in items:
            self._accept(plural, doc)
        self._rebuild()
        for doc in items:
            await self._report((plural, _name(doc)))

    def evaluate(self, listed: Iterable[tuple[str, dict[str, Any]]]) -> PolicySet:
        """The policy set these listed objects (plural, object) put in force, by the same rules as the watch
        (each validated alone and with the others; a refused one falls back to its last valid version),
        without writing anything: what ``xidflow replay`` compares a candidate against."""
        for plural, doc in listed:
            self._accept(plural, doc)
        self._rebuild()
        return self.current

    def _accept(self, plural: str, doc: dict[str, Any]) -> None:
        """Validate one object alone and with the others in force; valid versions replace the one in force."""
        key = (plural, _name(doc))
        tracked = self._tracked.get(key) or Tracked(doc)
        tracked.doc = doc
        try:
            parse_document(doc)
            others = [t.valid for k, t in self._tracked.items() if k != key and t.valid is not None]
            build_policy_set([*others, doc])
        except PolicyError as exc:
            tracked.error = str(exc)
            if tracked.valid is None:
                tracked.valid = self._recorded_version(key, doc)
            if tracked.valid is not None:
                log.error(
                    "%s/%s generation %s refused (%s); generation %s stays in force",
                    PLURALS[plural], key[1], tracked.generation, exc, tracked.valid_generation,
                )
            else:
                log.error("%s/%s refused: %s", PLURALS[plural], key[1], exc)
        else:
            tracked.valid, tracked.error = doc, None
        self._tracked[key] = tracked

    def _recorded_version(self, key: Key, doc: Mapping[str, Any]) -> dict[str, Any] | None:
        """The version in force recorded in the object's status, when it is still valid (after a restart)."""
        recorded = version_in_force_from_status(doc)
        if recorded is None:
            return None
        try:
            parse_document(recorded)
            build_policy_set([*(t.valid for k, t in self._tracked.items() if k != key and t.valid), recorded])
        except PolicyError:
            return None
        return recorded

    def _rebuild(self) -> None:
        try:
            self.current = build_policy_set(t.valid for _, t in sorted(self._tracked.items()) if t.valid)
        except PolicyError as exc:  # cannot happen after _accept's checks; keep what is in force
            log.error("policies could not be combined (%s); keeping the previous set", exc)
        self.errors = [t.error for _, t in sorted(self._tracked.items()) if t.error]
        self.changed.set()

    # -- reporting ----------------------------------------------------------------------------------------
    async def _report(self, key: Key) -> None:
        """Write the object's status (when it says something else) and a Warning Event for a refused generation."""
        tracked = self._tracked.get(key)
        if tracked is None or self.kube is None:
            return
        desired = desired_status(tracked)
        if status_matches(tracked.doc.get("status"), desired):
            return
        plural, name = key
        now = _now_rfc3339()
        body = {"status": {**desired, "conditions": [{**desired["conditions"][0], "lastTransitionTime": now}]}}
        try:
            written = await self.kube.patch_cluster_object_status(API_GROUP, API_VERSION, plural, name, body)
            tracked.doc = {**tracked.doc, "status": written.get("status")}
            if tracked.error is not None:
                await self._warn(tracked)
        except NotFound:
            return  # deleted meanwhile; the watch will say so
        except Forbidden as exc:
            if not self._status_forbidden_logged:
                log.warning("cannot write policy status or Events (%s); grant rescuepolicies/status patch", exc)
                self._status_forbidden_logged = True
        except (KubeError, KubeUnavailable) as exc:
            log.warning("writing the status of %s/%s failed: %s", PLURALS[plural], name, exc)

    async def _warn(self, tracked: Tracked) -> None:
        assert self.kube is not None
        meta = tracked.doc.get("metadata") or {}
        name, uid = str(meta.get("name")), str(meta.get("uid", ""))
        involved = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": tracked.doc.get("kind"),
            "name": name,
            "uid": uid,
            "resourceVersion": meta.get("resourceVersion"),
        }
        # One Event per refused generation, whichever replica writes it.
        event = f"{name[:200]}.{stable_id(uid, tracked.generation, 'invalid')[:16]}"
        message = desired_status(tracked)["conditions"][0]["message"]
        await create_event_once(self.kube, EVENT_NAMESPACE, event, involved, "InvalidPolicy", message)

    # -- watching -----------------------------------------------------------------------------------------
    @property
    def watching(self) -> bool:
        return any(not task.done() for task in self._watchers)

    def start_watching(self) -> None:
        """Follow the CRDs by watch (after :meth:`refresh` chose them); a no-op for file or built-in policies
        until a later refresh finds the CRDs installed."""
        self._watch_wanted = True
        if self.kube is None or self.source != "crd" or self.watching:
            return
        self._watchers = [
            asyncio.create_task(self._watch(plural), name=f"policy-watch-{plural}") for plural in PLURALS
        ]

    async def stop_watching(self) -> None:
        self._watch_wanted = False
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._watchers = []

    async def _watch(self, plural: str) -> None:
        assert self.kube is not None
        backoff = 0.5
        while True:
            try:
                if self._versions.get(plural) is None:
                    await self._list(plural)
                async for event in self.kube.watch_cluster_objects(
                    API_GROUP,
                    API_VERSION,
                    plural,
                    self._versions.get(plural),
                    self.settings.policy_label_selector,
                    timeout_seconds=max(1, int(self.settings.policy_refresh_seconds)),
                ):
                    await self._on_event(plural, event)
                    backoff = 0.5
                self._versions[plural] = None  # the server ended the watch: resync by listing again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the policies in force and try again
                if not unreachable(exc):  # an outage is logged once, as such (reachability.API_SERVER)
                    log.warning("watching %s failed (%s); listing again in %.1fs", plural, exc, backoff)
                self._versions[plural] = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _on_event(self, plural: str, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # typically 410 Gone: the resourceVersion is too old
            self._versions[plural] = None
            raise KubeUnavailable(f"watch error: {(obj or {}).get('message', obj)}")
        self._versions[plural] = (obj.get("metadata") or {}).get("resourceVersion") or self._versions.get(plural)
        if kind == "BOOKMARK":
            return
        key = (plural, _name(obj))
        if kind == "DELETED":
            self._tracked.pop(key, None)
            self._rebuild()
            return
        self._accept(plural, dict(obj))
        self._rebuild()
        await self._report(key)


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _name(doc: Mapping[str, Any]) -> str:
    return str((doc.get("metadata") or {}).get("name"))


def _age_order(doc: Mapping[str, Any]) -> tuple[str, str]:
    meta = doc.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name"))


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
