"""The local control plane's pure parts: command lines, KWOK's stages (the module's, one selector added), the
client certificates, and the simulated machines' Node objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from pipeline.actuator.machines import KWOK_LABELS, hostname, node_object, node_usable
from pipeline.actuator.nodeview import NodeView
from pipeline.localinfra import controlplane, install, kwok
from pipeline.localinfra.controlplane import (
    CLIENT_QPS,
    CLIENTS,
    DRA_FEATURE_GATES,
    DRA_FLAGS,
    controller_manager_command,
    scheduler_command,
    write_pki,
)
from pipeline.localinfra.install import InstallError


def flags(cmd: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in cmd[1:])


def test_controller_manager_runs_every_default_controller_with_its_own_credentials() -> None:
    cmd = controller_manager_command(Path("/bin/kcm"), kubeconfig=Path("/s/kcm.kubeconfig"), pki=Path("/s/pki"),
                                     port=4242, node_monitor_grace_s=20)
    f = flags(cmd)
    assert cmd[0] == "/bin/kcm"
    assert f["controllers"] == "*"  # node lifecycle, ReplicaSet, Job, disruption, GC, ... as a cluster runs them
    assert f["use-service-account-credentials"] == "true"
    assert f["service-account-private-key-file"] == "/s/pki/sa.key" and f["root-ca-file"] == "/s/pki/ca.crt"
    assert f["leader-elect"] == "false" and f["node-monitor-grace-period"] == "20s"
    assert f["kubeconfig"] == f["authentication-kubeconfig"] == f["authorization-kubeconfig"] == "/s/kcm.kubeconfig"
    assert f["bind-address"] == "127.0.0.1" and f["secure-port"] == "4242"


def test_controllers_and_scheduler_get_the_api_servers_dra_feature_gates() -> None:
    """The device-taint eviction controller runs only with DRADeviceTaints; the API server serves DeviceTaintRules
    only with DRADeviceTaintRules: every component gets the same gates."""
    kcm = controller_manager_command(Path("k"), kubeconfig=Path("c"), pki=Path("p"), port=1, node_monitor_grace_s=50)
    sched = scheduler_command(Path("s"), kubeconfig=Path("c"), port=2)
    assert DRA_FEATURE_GATES in DRA_FLAGS
    assert DRA_FEATURE_GATES in kcm and DRA_FEATURE_GATES in sched
    assert flags(sched)["leader-elect"] == "false"


def test_kwok_manages_nodes_by_label_with_a_kubelets_lease() -> None:
    cmd = kwok.command(Path("/bin/kwok"), kubeconfig=Path("/s/kwok.kubeconfig"), config=Path("/s/kwok.yaml"),
                       port=7, lease_seconds=40)
    f = flags(cmd)
    assert f["manage-nodes-with-label-selector"] == "kwok.x-k8s.io/node=fake"
    assert f["node-lease-duration-seconds"] == "40" and f["config"] == "/s/kwok.yaml"
    assert f["server-address"] == "127.0.0.1:7"


def module_files(tmp_path: Path) -> Path:
    """A KWOK module layout with the module's pod-complete stage as v0.8.0 ships it (abridged template)."""
    stage = tmp_path / "kustomize/stage/pod/fast/pod-complete.yaml"
    stage.parent.mkdir(parents=True)
    stage.write_text(
        "apiVersion: kwok.x-k8s.io/v1alpha1\nkind: Stage\nmetadata:\n  name: pod-complete\nspec:\n"
        "  resourceRef: {apiGroup: v1, kind: Pod}\n  selector:\n    matchExpressions:\n"
        "    - {key: '.status.phase', operator: 'In', values: ['Running']}\n"
        "    - {key: '.metadata.ownerReferences.[].kind', operator: 'In', values: ['Job']}\n"
        "  next:\n    statusTemplate: 'phase: Succeeded'\n"
    )
    ready = tmp_path / "kustomize/stage/pod/fast/pod-ready.yaml"
    ready.write_text("kind: Stage\nmetadata: {name: pod-ready}\nspec: {selector: {matchExpressions: []}}\n")
    return tmp_path


def test_pod_complete_gains_one_opt_out_and_keeps_the_modules_selector(tmp_path: Path) -> None:
    files = module_files(tmp_path)
    stages = kwok.load_stages(files, ["kustomize/stage/pod/fast/pod-ready.yaml",
                                      "kustomize/stage/pod/fast/pod-complete.yaml"])
    ready, complete = stages
    assert ready == yaml.safe_load((files / "kustomize/stage/pod/fast/pod-ready.yaml").read_text())
    expressions = complete["spec"]["selector"]["matchExpressions"]
    assert expressions[:2] == [
        {"key": ".status.phase", "operator": "In", "values": ["Running"]},
        {"key": ".metadata.ownerReferences.[].kind", "operator": "In", "values": ["Job"]},
    ]
    assert expressions[2:] == [
        {"key": '.metadata.labels["pod-complete.stage.kwok.x-k8s.io"]', "operator": "NotIn", "values": ["false"]},
    ]
    assert complete["spec"]["next"] == {"statusTemplate": "phase: Succeeded"}  # what KWOK does is the module's
    options, *rest = list(yaml.safe_load_all(kwok.config_text(stages)))
    assert rest == stages
    assert options["kind"] == "KwokConfiguration"
    assert options["options"]["nodeLeaseParallelism"] == options["options"]["nodePlayStageParallelism"] > 4


def test_a_missing_stage_file_says_which_and_where(tmp_path: Path) -> None:
    with pytest.raises(InstallError, match="pod-delete.yaml"):
        kwok.load_stages(module_files(tmp_path), ["kustomize/stage/pod/fast/pod-delete.yaml"])


def test_select_pod_complete_leaves_other_stages_alone() -> None:
    stage = {"kind": "Stage", "metadata": {"name": "pod-delete"}, "spec": {"selector": {"matchExpressions": []}}}
    assert kwok.select_pod_complete(stage) is stage


def test_kwoks_role_is_the_modules_cluster_role(tmp_path: Path) -> None:
    role = tmp_path / kwok.RBAC_ROLE
    role.parent.mkdir(parents=True)
    role.write_text("---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n"
                    "  name: kwok-controller\nrules: []\n")
    assert kwok.role(tmp_path)["metadata"]["name"] == "kwok-controller"
    role.write_text("kind: ServiceAccount\nmetadata: {name: x}\n")
    with pytest.raises(InstallError, match="one ClusterRole"):
        kwok.role(tmp_path)


def test_every_component_gets_a_client_certificate_and_an_upgrade_keeps_existing_ones(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    write_pki(pki)
    for stem, (user, group) in CLIENTS.items():
        cert = x509.load_pem_x509_certificate((pki / f"{stem}.crt").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == user
        assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] == (
            [group] if group else [])
    assert CLIENTS["kube-controller-manager"][0] == "system:kube-controller-manager"  # bootstrap RBAC's user
    assert CLIENTS["kube-scheduler"][0] == "system:kube-scheduler"
    before = {p.name: p.read_bytes() for p in pki.iterdir()}
    (pki / "kwok.crt").unlink()
    write_pki(pki)
    after = {p.name: p.read_bytes() for p in pki.iterdir()}
    assert set(after) == set(before) and after["kwok.crt"] != before["kwok.crt"]
    assert {k: v for k, v in after.items() if not k.startswith("kwok.")} == {
        k: v for k, v in before.items() if not k.startswith("kwok.")}


def test_one_go_build_makes_all_four_binaries_the_go_mod_pins() -> None:
    text = install.GOMOD.read_text()
    tools = text.split("tool (", 1)[1].split(")", 1)[0].split()
    assert sorted(tools) == sorted(install.CONTROLPLANE_PACKAGES)
    assert "regen.sh" in text.splitlines()[2]  # the header names what generates it
    assert (install.GOMOD.parent / "regen.sh").exists()
    assert install.KWOK_MODULE in install.KWOK_GOMOD.read_text() and install.kwok_version().startswith("v")


def test_a_machine_registers_as_a_kwok_node_with_its_boot_id_and_gpus() -> None:
    obj = node_object("gpu-1", {"pool": "a"}, boot_id="b-7", gpu=True)
    assert obj["metadata"]["labels"]["kwok.x-k8s.io/node"] == "fake"
    info = obj["status"]["nodeInfo"]
    assert info["bootID"] == "b-7" and not any(v for k, v in info.items() if k != "bootID")  # KWOK fills the rest
    assert obj["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert "conditions" not in obj["status"]  # Ready is KWOK's to report
    assert NodeView.from_object(obj).boot_id == "b-7"
    unmanaged = node_object("n", {"a": "b"}, managed=False)
    assert unmanaged["metadata"]["labels"] == {"kubernetes.io/hostname": "n", "a": "b"}
    assert dict(KWOK_LABELS) == {kwok.MANAGED_LABEL[0]: kwok.MANAGED_LABEL[1]}


@pytest.mark.parametrize(("conditions", "taints", "usable"), [
    ([{"type": "Ready", "status": "True"}], [], True),
    ([{"type": "Ready", "status": "True"}], [{"key": "nvidia.com/gpu-fault", "effect": "NoSchedule"}], True),
    ([{"type": "Ready", "status": "True"}], [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}], False),
    ([{"type": "Ready", "status": "Unknown"}], [], False),
    ([], [], False),
])
def test_a_node_is_usable_when_ready_and_the_lifecycle_controller_lifted_its_taints(
    conditions: list, taints: list, usable: bool
) -> None:
    assert node_usable({"status": {"conditions": conditions}, "spec": {"taints": taints}}) is usable


def test_components_are_listed_in_start_order() -> None:
    assert controlplane.COMPONENTS == ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def test_a_long_node_name_registers_a_hostname_a_label_can_hold() -> None:
    long = "gpu-" + "h100-sxm5-prod-us-east-1a-rack07-" * 3 + "node-0002"
    label = node_object(long, {})["metadata"]["labels"]["kubernetes.io/hostname"]
    assert len(long) > 63 and label == hostname(long) and len(label) <= 63 and long.startswith(label)
    assert not label.endswith(("-", ".")) and hostname("gpu-1") == "gpu-1"


def test_controllers_and_scheduler_use_a_large_clusters_client_rate() -> None:
    """The node lifecycle controller answers every new node and every cordon at its client's rate: the rate
    Kubernetes' own 5,000-node scalability jobs give the controller-manager and the scheduler, not 20/s."""
    kcm = flags(controller_manager_command(Path("k"), kubeconfig=Path("c"), pki=Path("p"), port=1,
                                           node_monitor_grace_s=50))
    sched = flags(scheduler_command(Path("s"), kubeconfig=Path("c"), port=2))
    for f in (kcm, sched):
        assert f["kube-api-qps"] == f["kube-api-burst"] == str(CLIENT_QPS)
    assert CLIENT_QPS >= 100
