"""The drain's filters: which pods a drain leaves alone, xidflow's own among them."""

from __future__ import annotations

from typing import Any

from pipeline.actuator.actions.drain import OWN_LABEL, default_filters, drain_candidates, own_pods


def pod(namespace: str, name: str, labels: dict[str, str] | None = None, owner: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": namespace, "name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [{"kind": owner, "name": "o"}]
    return {"metadata": meta, "status": {"phase": "Running"}}


OURS = dict([OWN_LABEL])


def test_xidflows_own_pods_are_those_labelled_so_in_the_actuators_namespace() -> None:
    own = own_pods("xidflow-system")
    assert own(pod("xidflow-system", "xidflow-actuator-0", OURS))
    assert not own(pod("xidflow-system", "someone-else"))  # no label: a user's pod in that namespace
    assert not own(pod("training", "lookalike", OURS))  # the label elsewhere proves nothing


def test_a_drain_leaves_xidflow_and_daemonsets_alone_and_evicts_the_rest() -> None:
    pods = [pod("xidflow-system", "xidflow-worker-0", OURS), pod("xidflow-system", "probe-x", OURS, "DaemonSet"),
            pod("ops", "fluent-bit-y", owner="DaemonSet"), pod("training", "trainer-0"),
            pod("training", "lookalike", OURS)]
    evict, alone = drain_candidates(pods, set(), default_filters((), "xidflow-system"))
    assert [p["metadata"]["name"] for p in evict] == ["trainer-0", "lookalike"]
    assert alone == ["xidflow-system/xidflow-worker-0", "xidflow-system/probe-x", "ops/fluent-bit-y"]
    # Without the actuator's namespace (a caller that has none) only the kinds a drain never evicts stay.
    evict, _ = drain_candidates(pods, set(), default_filters())
    assert "xidflow-worker-0" in [p["metadata"]["name"] for p in evict]
