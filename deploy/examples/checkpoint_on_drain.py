"""Save a checkpoint when xidflow is about to drain the node: a few lines for a PyTorch training loop.

A drain with ``checkpointGrace`` (see the README, "Checkpoint before a drain") sets the pod condition
``xidflow.dev/CheckpointRequested=True`` on each GPU pod it is about to evict and waits until the pod
sets ``xidflow.dev/CheckpointDone=True`` on itself, or until the grace is over. ``CheckpointSignal``
watches the pod's own conditions on a background thread and writes the answer::

    signal = CheckpointSignal.from_env()          # POD_NAMESPACE / POD_NAME from the downward API
    for step, batch in enumerate(loader):
        train_step(batch)
        if signal.requested():                    # a cheap flag read, no API call per step
            torch.save(state, path)
            signal.done(f"step {step} saved")     # xidflow evicts the pod now, not at the deadline

Rights the pod's ServiceAccount needs in its namespace (deploy/examples/checkpoint-job.yaml):
``get``, ``list``, ``watch`` on ``pods`` and ``patch`` on ``pods/status``. Needs only the
``kubernetes`` Python package; run as a script it trains a small model with PyTorch.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config, watch

REQUESTED = "xidflow.dev/CheckpointRequested"
DONE = "xidflow.dev/CheckpointDone"
STRATEGIC = "application/strategic-merge-patch+json"  # pod conditions merge by type: the others stay


def _kube() -> client.CoreV1Api:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()  # outside a pod ($KUBECONFIG), e.g. a test
    return client.CoreV1Api()


class CheckpointSignal:
    """``requested()`` turns True when xidflow asks this pod for a checkpoint; ``done()`` answers."""

    def __init__(self, namespace: str, name: str, core: client.CoreV1Api | None = None) -> None:
        self.namespace, self.name = namespace, name
        self.core = core or _kube()
        self.message = ""
        """The request's message: the fault and the deadline of the eviction."""
        self._asked = threading.Event()
        threading.Thread(target=self._follow, name="checkpoint-signal", daemon=True).start()

    @classmethod
    def from_env(cls) -> CheckpointSignal:
        return cls(os.environ["POD_NAMESPACE"], os.environ["POD_NAME"])

    def requested(self) -> bool:
        return self._asked.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a checkpoint is requested (for a loop that polls nothing)."""
        return self._asked.wait(timeout)

    def done(self, message: str = "checkpoint saved") -> None:
        """Tell xidflow the checkpoint is saved: the pod may be evicted now."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {"type": DONE, "status": "True", "reason": "CheckpointSaved", "message": message[:1024],
                "lastTransitionTime": now, "lastProbeTime": None}
        self.core.patch_namespaced_pod_status(
            self.name, self.namespace, {"status": {"conditions": [cond]}}, _content_type=STRATEGIC
        )
        self._asked.clear()

    def _see(self, pod: Any) -> None:
        conds = {c.type: c for c in (pod.status.conditions or [])}
        asked, answered = conds.get(REQUESTED), conds.get(DONE)
        # A new request resets CheckpointDone to False, so "asked and not answered" is the whole rule.
        if asked is not None and asked.status == "True" and (answered is None or answered.status != "True"):
            self.message = asked.message or ""
            self._asked.set()

    def _follow(self) -> None:
        while True:
            try:
                for event in watch.Watch().stream(
                    self.core.list_namespaced_pod, self.namespace,
                    field_selector=f"metadata.name={self.name}", timeout_seconds=300,
                ):
                    self._see(event["object"])
            except Exception:  # noqa: BLE001 - an API server restart must not end the training
                time.sleep(1)


def train(path: str = "/checkpoints/model.pt", steps: int = 1_000_000) -> None:
    """A PyTorch training loop that saves a checkpoint when xidflow asks, then stops."""
    import torch

    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    signal = CheckpointSignal.from_env()
    for step in range(steps):
        x = torch.randn(64, 1024)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if signal.requested():
            torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, path)
            signal.done(f"step {step} saved to {path}")
            return  # the pod is evicted next; the Job's next pod resumes from the file


if __name__ == "__main__":
    train(os.environ.get("CHECKPOINT_PATH", "/checkpoints/model.pt"))
