"""Where the policies come from: RescuePolicy/WarmStandbyPolicy CRDs when installed, else a YAML file."""

from __future__ import annotations

import logging
import time

from pipeline.actuator.kube import Kube
from pipeline.actuator.policy import (
    API_GROUP,
    API_VERSION,
    RESCUE_PLURAL,
    STANDBY_PLURAL,
    PolicyError,
    PolicySet,
    build_policy_set,
    load_yaml_file,
)
from pipeline.actuator.settings import ActuatorSettings

log = logging.getLogger("xidflow.actuator.policy")


class PolicyStore:
    """Holds the current PolicySet; ``refresh`` reloads it, keeping the last good set on errors."""

    def __init__(self, kube: Kube | None, settings: ActuatorSettings, initial: PolicySet | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.current = initial or PolicySet()
        self.source = "built-in" if initial is None else "given"
        self.errors: list[str] = []
        self._loaded_at = 0.0

    async def _use_crds(self) -> bool:
        if self.settings.policy_source == "file":
            return False
        if self.settings.policy_source == "crd":
            return True
        assert self.kube is not None
        return await self.kube.crd_installed(f"{RESCUE_PLURAL}.{API_GROUP}")

    async def refresh(self) -> PolicySet:
        """Reload now. Invalid objects are reported in ``errors`` and left out; the others load."""
        self.errors = []
        if self.kube is not None and await self._use_crds():
            docs = []
            for plural in (RESCUE_PLURAL, STANDBY_PLURAL):
                docs += await self.kube.list_cluster_objects(
                    API_GROUP, API_VERSION, plural, self.settings.policy_label_selector
                )
            good = []
            for doc in docs:
                try:
                    build_policy_set([doc])
                    good.append(doc)
                except PolicyError as exc:
                    self.errors.append(str(exc))
                    log.error("policy rejected: %s", exc)
            self.current = build_policy_set(good)
            self.source = "crd"
        elif self.settings.policy_file:
            self.current = load_yaml_file(self.settings.policy_file)
            self.source = f"file:{self.settings.policy_file}"
        self._loaded_at = time.monotonic()
        return self.current

    async def maybe_refresh(self) -> PolicySet:
        if time.monotonic() - self._loaded_at >= self.settings.policy_refresh_seconds:
            try:
                await self.refresh()
            except Exception:  # keep acting on the last good policies
                log.exception("policy refresh failed; keeping the previous policies")
                self._loaded_at = time.monotonic()
        return self.current
