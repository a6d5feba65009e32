"""KWOK, the node and pod simulator of Kubernetes SIGs: the kubelets of the local cluster.

``install.ensure_kwok`` builds it from its Go module and copies the module's own ``kustomize/stage``
and ``kustomize/rbac`` files beside the binary; this module configures KWOK from those files. The
stages are the module's, with one selector added and one stage of a kubelet's that the module lacks
(``POD_STOP_STAGE``), and its permissions are the module's ClusterRole.

What KWOK does here (the stages, ``STAGES``):

- nodes labelled ``MANAGED_LABEL`` (``kwok.x-k8s.io/node=fake``) are KWOK's: ``node-initialize`` makes
  a node that is not Ready Ready (keeping the ``status.nodeInfo.bootID``, capacity and allocatable it
  was created with); KWOK renews its Lease in ``kube-node-lease`` every quarter of
  ``--node-lease-duration-seconds`` and ``node-heartbeat-with-lease`` refreshes its status every 10 to
  20 minutes, as a kubelet with node leases does. A label, not an annotation: KWOK watches nodes
  with a server-side label selector, so removing the label is a watch ``DELETED`` for KWOK, which then
  stops renewing the node's Lease (the machine is gone; the node lifecycle controller marks it
  ``Unknown`` and taints it ``node.kubernetes.io/unreachable`` after its grace period). Nodes without
  the label are nobody's: they go NotReady as on a cluster whose kubelet is dead;
- ``pod-ready`` runs a scheduled pod on a KWOK node (Running, Ready); ``pod-delete`` finalises a
  deleted pod at once (no containers to stop);
- ``POD_STOP_STAGE`` (the one stage of our own) first does what a kubelet does to a running pod that is
  deleted or evicted: it stops the containers (exit code 143, SIGTERM's) and reports the pod ``Failed``,
  keeping its conditions (``DisruptionTarget``, another writer's). Without it a pod that carries a
  finalizer (every pod of a Job: ``batch.kubernetes.io/job-tracking``) would stay Running and
  Terminating for ever, since the Job controller counts a pod, and lets it go, only once it is terminal;
  with it the Job controller sees what it sees on a cluster (a Failed pod with its conditions) and its
  ``podFailurePolicy`` decides. Pods without a finalizer go on to ``pod-delete`` as before;
- ``pod-complete`` ends a running pod owned by a Job (Succeeded, exit code 0), unless the pod carries
  ``POD_COMPLETE_LABEL: "false"`` (the one selector added here): a Job that must keep running (a
  training job that checkpoints) sets it in its pod template;
- ``pod-container-running-failed`` (the module's chaos stage) fails a running pod labelled
  ``POD_FAIL_LABEL: "true"`` after about a second (exit code 1, or the annotation
  ``<POD_FAIL_LABEL>/exit-code``): a Job whose pod must fail sets it. Its weight wins over
  ``pod-complete``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from pipeline.localinfra.install import InstallError

MANAGED_LABEL = ("kwok.x-k8s.io/node", "fake")
"""The label of the nodes KWOK manages (``--manage-nodes-with-label-selector``)."""
POD_COMPLETE_LABEL = "pod-complete.stage.kwok.x-k8s.io"
"""A Job's pod labelled with this, value ``"false"``, is never completed by KWOK (it runs until deleted)."""
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
"""A running pod labelled with this, value ``"true"``, is failed by KWOK (KWOK's own chaos stage)."""

STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
    "kustomize/stage/pod/chaos/pod-container-running-failed.yaml",
)
"""The module's Stage files KWOK runs with (paths inside the module)."""
POD_STOP_STAGE: dict[str, Any] = yaml.safe_load(r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-stop
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'Exists'}
    - {key: '.status.phase', operator: 'In', values: ['Running']}
  weight: 1
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "False"
        reason: PodFailed
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "False"
        reason: PodFailed
        type: ContainersReady
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 143
            reason: Error
            finishedAt: {{ $now | Quote }}
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Failed
""")
"""What a kubelet does to a running pod that is deleted (evicted): its containers stopped, the pod ``Failed``.

Its weight wins over the module's ``pod-delete`` while the pod still runs; once it is Failed only
``pod-delete`` matches and finishes it (after the Job controller has let go of a Job's pod).
"""
RBAC_ROLE = "kustomize/rbac/role.yaml"
"""The module's ClusterRole of the KWOK controller (what it may read and write)."""


# -- the stages: the module's files, one selector added (pure) -------------------------------------------------
def load_stages(module_files: Path, files: Iterable[str] = STAGES) -> list[dict[str, Any]]:
    """The module's Stage objects, as KWOK's ``--config`` takes them, with ``select_pod_complete`` applied."""
    stages = []
    for rel in files:
        path = module_files / rel
        if not path.is_file():
            raise InstallError(f"the KWOK module files at {module_files} lack {rel}: did the module change its layout?")
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                stages.append(select_pod_complete(doc))
    return stages


def select_pod_complete(stage: dict[str, Any]) -> dict[str, Any]:
    """``pod-complete`` gains one requirement: the pod is not labelled ``POD_COMPLETE_LABEL: "false"``.

    Any other stage is returned unchanged. The module's stage completes every running pod a Job owns,
    at once; a Job whose pod must keep running opts out with the label (KWOK's own naming of per-stage
    labels, ``<stage>.stage.kwok.x-k8s.io``). A pod without the label matches as before.
    """
    if stage.get("kind") != "Stage" or stage.get("metadata", {}).get("name") != "pod-complete":
        return stage
    out = copy.deepcopy(stage)
    expressions = out["spec"].setdefault("selector", {}).setdefault("matchExpressions", [])
    expressions.append({"key": f'.metadata.labels["{POD_COMPLETE_LABEL}"]', "operator": "NotIn", "values": ["false"]})
    return out


PARALLELISM = 32
"""Nodes KWOK moves through a stage, and node Leases it renews, at once (its default: 4 each).

Every kubelet of a cluster reports its own node and renews its own Lease, whatever the others do; KWOK, one
process for all of them, works through them 4 at a time by default, each a round trip to the API server.
On these shared cores a round trip took 0.3-1 s at times, and 500 new nodes took KWOK 80 s to make Ready
(KWOK itself used 6 CPU seconds of it): the waits, not KWOK's work. More at once is closer to what the
kubelets do, and no more work."""


def configuration(parallelism: int = PARALLELISM) -> dict[str, Any]:
    """KWOK's own options (a ``KwokConfiguration`` document of its ``--config``). Pure.

    Given a document, KWOK takes no default for the parallelisms it leaves out (0: it refuses to start), so the
    pods' is KWOK's default, written out."""
    return {"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
            "options": {"nodePlayStageParallelism": parallelism, "nodeLeaseParallelism": parallelism,
                        "podPlayStageParallelism": 4, "podsOnNodeSyncParallelism": 1}}


def all_stages(module_files: Path) -> list[dict[str, Any]]:
    """What KWOK runs with here: the module's ``STAGES`` (``load_stages``) and ``POD_STOP_STAGE``."""
    return [*load_stages(module_files), copy.deepcopy(POD_STOP_STAGE)]


def config_text(stages: Sequence[dict[str, Any]]) -> str:
    """KWOK's ``--config`` file: its options (``configuration``) and the stages, as one multi-document YAML."""
    return yaml.safe_dump_all([configuration(), *stages], sort_keys=False)


def command(binary: Path, *, kubeconfig: Path, config: Path, port: int, lease_seconds: int) -> list[str]:
    """KWOK's command line (pure): nodes by label, leases as a kubelet's, health on loopback."""
    key, value = MANAGED_LABEL
    return [
        str(binary), f"--kubeconfig={kubeconfig}", f"--config={config}",
        f"--manage-nodes-with-label-selector={key}={value}",
        f"--node-lease-duration-seconds={lease_seconds}",
        # Pod IPs come from a range of their own, apart from the API server's service range (10.0.0.0/24).
        "--cidr=10.244.0.1/16",
        f"--server-address=127.0.0.1:{port}",
    ]


def role(module_files: Path) -> dict[str, Any]:
    """The module's ClusterRole of the KWOK controller."""
    docs = [d for d in yaml.safe_load_all((module_files / RBAC_ROLE).read_text()) if d]
    roles = [d for d in docs if d.get("kind") == "ClusterRole"]
    if len(roles) != 1:
        raise InstallError(f"{module_files / RBAC_ROLE}: expected one ClusterRole, found {len(roles)}")
    return roles[0]
