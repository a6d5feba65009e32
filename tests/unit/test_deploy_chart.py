"""The Helm chart, rendered with the pinned helm binary (built once by Go, cached): what it installs.

These checks read the rendered manifests; tests/integration/test_deploy.py sends every one of them
to a real kube-apiserver with server-side dry run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.localinfra.helm import helm_template

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "xidflow"
ALL_ENABLED = CHART / "ci" / "all-enabled-values.yaml"
KAFKA_SECURITY = CHART / "ci" / "kafka-security-values.yaml"
NS = "xf-system"


def render(*values_files: Path, **set_values: object) -> list[dict[str, Any]]:
    text = helm_template(CHART, release="rel", namespace=NS, values_files=values_files,
                         set_values=set_values, log=lambda _m: None)
    return [d for d in yaml.safe_load_all(text) if d]


def one(docs: list[dict], kind: str, name_suffix: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def all_docs() -> list[dict]:
    return render(ALL_ENABLED)


def test_chart_crds_are_copies_of_deploy_crds() -> None:
    source = {p.name: p.read_bytes() for p in (ROOT / "deploy" / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert source, "deploy/crds/ has no CRDs"
    assert chart.keys() == source.keys(), "chart crds/ and deploy/crds/ list different files"
    stale = [name for name in source if chart[name] != source[name]]
    assert not stale, f"chart crds/ differ from deploy/crds/ (copy them again): {stale}"


def test_default_install_has_every_component(default_docs: list[dict]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in default_docs)
    assert ("Deployment", "rel-xidflow-worker") in kinds
    assert ("Deployment", "rel-xidflow-actuator") in kinds
    assert ("DaemonSet", "rel-xidflow-probe") in kinds
    assert ("DaemonSet", "rel-xidflow-fluent-bit") in kinds
    assert ("Service", "rel-xidflow-api") in kinds
    assert ("PodDisruptionBudget", "rel-xidflow-worker") in kinds
    assert ("PodDisruptionBudget", "rel-xidflow-actuator") in kinds
    # optional parts are off by default
    assert not [k for k in kinds if k[1].endswith("loki-tail")]
    # (the request-signing key Secret is not optional: rescue requests are always signed)
    assert not [k for k in kinds if k[0] in ("ServiceMonitor", "Secret", "RescuePolicy", "WarmStandbyPolicy")
                and not k[1].endswith("-signing")]
    for d in default_docs:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding"):
            assert d["metadata"]["namespace"] == NS, d["metadata"]["name"]


def test_first_install_is_dry_run_and_commands_are_the_cli(default_docs: list[dict]) -> None:
    actuator = one(default_docs, "Deployment", "-actuator")
    c = container(actuator)
    assert c["command"] == ["xidflow", "actuator"]
    assert env_of(c)["XIDFLOW_ACTUATOR_DRY_RUN"] == "true"
    assert actuator["spec"]["replicas"] >= 2
    assert container(one(default_docs, "Deployment", "-worker"))["command"] == ["xidflow", "worker"]
    probe = container(one(default_docs, "DaemonSet", "-probe"))
    assert probe["command"] == ["xidflow", "probe"]
    assert "--node=$(NODE_NAME)" in probe["args"]
    assert env_of(probe)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_configuration_env_from_values() -> None:
    docs = render(**{"kafka.bootstrapServers": "k1:9092,k2:9092", "kafka.topicPrefix": "stage.",
                     "actuator.dryRun": False, "metrics.port": 9500, "actuator.api.port": 8181})
    for kind, suffix in (("Deployment", "-worker"), ("Deployment", "-actuator"), ("DaemonSet", "-probe")):
        env = env_of(container(one(docs, kind, suffix)))
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "k1:9092,k2:9092"
        assert env["XIDFLOW_TOPIC_PREFIX"] == "stage."
        assert env["XIDFLOW_METRICS_PORT"] == "9500"
        ports = {p["name"]: p["containerPort"] for p in container(one(docs, kind, suffix))["ports"]}
        assert ports["metrics"] == 9500
    actuator = container(one(docs, "Deployment", "-actuator"))
    env = env_of(actuator)
    assert env["XIDFLOW_ACTUATOR_DRY_RUN"] == "false"
    assert env["XIDFLOW_API_PORT"] == "8181"
    assert {p["name"]: p["containerPort"] for p in actuator["ports"]}["http"] == 8181
    assert env["XIDFLOW_ACTUATOR_NAMESPACE"] == NS
    assert env["XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR"] == "nvidia.com/gpu.present=true"
    fb = one(docs, "ConfigMap", "-fluent-bit")
    config = yaml.safe_load(fb["data"]["fluent-bit.yaml"])
    outputs = config["pipeline"]["outputs"]
    assert {o["topics"] for o in outputs} == {"stage.gpu.logs.kernel", "stage.gpu.logs.pods"}
    assert {o["brokers"] for o in outputs} == {"k1:9092,k2:9092"}


def test_security_contexts(default_docs: list[dict]) -> None:
    for suffix in ("-worker", "-actuator"):
        d = one(default_docs, "Deployment", suffix)
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        c = container(d)
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"] and c["resources"]["limits"]
    probe = one(default_docs, "DaemonSet", "-probe")
    pod = probe["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 0  # NVML opens /dev/nvidia*
    assert "runtimeClassName" not in pod  # the node's default runtime (see the runtime-class test below)
    assert env_of(container(probe))["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert container(probe)["resources"]["limits"]


def test_probe_only_on_gpu_nodes_and_tolerates_quarantine(default_docs: list[dict]) -> None:
    pod = one(default_docs, "DaemonSet", "-probe")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    keys = {t.get("key") for t in pod["tolerations"]}
    assert "nvidia.com/gpu-fault" in keys  # the actuator's default quarantine taint
    docs = render(**{"actuator.taint.key": "example.com/gpu-bad", "probe.nodeSelector.pool": "train"})
    pod = one(docs, "DaemonSet", "-probe")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "train"}
    assert "example.com/gpu-bad" in {t.get("key") for t in pod["tolerations"]}
    actuator_env = env_of(container(one(docs, "Deployment", "-actuator")))
    assert actuator_env["XIDFLOW_ACTUATOR_TAINT_KEY"] == "example.com/gpu-bad"


CONTROL = (("Deployment", "-worker"), ("Deployment", "-actuator"), ("Deployment", "-loki-tail"))
NOT_GPU = {"nodeSelectorTerms": [{"matchExpressions": [
    {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}]}]}


def pod_spec(docs: list[dict], kind: str, suffix: str) -> dict:
    return one(docs, kind, suffix)["spec"]["template"]["spec"]


def test_control_components_stay_off_gpu_nodes_by_default(all_docs: list[dict]) -> None:
    """The worker, the actuator and loki-tail never run on a GPU node: a quarantine, drain or reboot of the node would
    take them with it (found by hand with the scheduler: by default they landed on GPU nodes)."""
    for kind, suffix in CONTROL:
        spec = pod_spec(all_docs, kind, suffix)
        assert spec["affinity"]["nodeAffinity"] == {"requiredDuringSchedulingIgnoredDuringExecution": NOT_GPU}, suffix
    # The actuator keeps its spread of replicas next to it.
    assert "podAntiAffinity" in pod_spec(all_docs, "Deployment", "-actuator")["affinity"]
    # Several GPU labels: a node lacking any one of them is no GPU node (terms are ORed).
    docs = render(**{"gpuNodeSelector.example\\.com/accelerator": "h100"})
    terms = pod_spec(docs, "Deployment", "-worker")["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = sorted(t["matchExpressions"][0]["key"] for t in terms)
    assert keys == ["example.com/accelerator", "nvidia.com/gpu.present"]
    preferred = pod_spec(render(avoidGpuNodes="preferred"), "Deployment", "-worker")["affinity"]["nodeAffinity"]
    assert preferred == {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": NOT_GPU["nodeSelectorTerms"][0]}]}
    anywhere = render(avoidGpuNodes="")
    assert "affinity" not in pod_spec(anywhere, "Deployment", "-worker")
    assert "nodeAffinity" not in pod_spec(anywhere, "Deployment", "-actuator")["affinity"]
    # A component's own nodeAffinity replaces the default; its other keys are added.
    own = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "pool", "operator": "In", "values": ["system"]}]}]}}
    docs = render(**{"worker.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                     ".nodeSelectorTerms[0].matchExpressions[0].key": "pool",
                     "worker.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                     ".nodeSelectorTerms[0].matchExpressions[0].operator": "In",
                     "worker.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                     ".nodeSelectorTerms[0].matchExpressions[0].values[0]": "system"})
    assert pod_spec(docs, "Deployment", "-worker")["affinity"] == {"nodeAffinity": own}
    with pytest.raises(Exception, match="avoidGpuNodes"):
        render(avoidGpuNodes="sometimes")


def test_control_components_tolerate_only_xidflows_own_no_execute_taint(all_docs: list[dict]) -> None:
    for kind, suffix in CONTROL:
        assert pod_spec(all_docs, kind, suffix)["tolerations"] == [
            {"key": "nvidia.com/gpu-fault", "operator": "Exists", "effect": "NoExecute"}], suffix
    docs = render(**{"actuator.tolerations[0].key": "pool", "actuator.tolerations[0].operator": "Exists"})
    assert pod_spec(docs, "Deployment", "-actuator")["tolerations"] == [
        {"key": "nvidia.com/gpu-fault", "operator": "Exists", "effect": "NoExecute"},
        {"key": "pool", "operator": "Exists"}]


def test_every_xidflow_pod_carries_the_label_the_drain_leaves_alone(all_docs: list[dict]) -> None:
    from pipeline.actuator.actions.drain import OWN_LABEL

    key, value = OWN_LABEL
    for d in all_docs:
        if d["kind"] in ("Deployment", "DaemonSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert labels.get(key) == value, d["metadata"]["name"]
            # Not in the selector: a Deployment's selector cannot change on upgrade.
            assert key not in d["spec"]["selector"]["matchLabels"]


def test_the_probe_runs_without_a_runtime_class_unless_one_is_named(default_docs: list[dict]) -> None:
    """The GPU Operator's RuntimeClass "nvidia" exists only where it installed it: naming it by default made the
    DaemonSet create no pod at all elsewhere."""
    assert "runtimeClassName" not in pod_spec(default_docs, "DaemonSet", "-probe")
    named = render(**{"probe.runtimeClassName": "nvidia"})
    assert pod_spec(named, "DaemonSet", "-probe")["runtimeClassName"] == "nvidia"


def test_prometheus_scraping(default_docs: list[dict], all_docs: list[dict]) -> None:
    for kind, suffix in (("Deployment", "-worker"), ("Deployment", "-actuator"), ("DaemonSet", "-probe")):
        ann = one(default_docs, kind, suffix)["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == "9400"
        assert ann["prometheus.io/path"] == "/metrics"
    sm = one(all_docs, "ServiceMonitor", "rel-xidflow")
    svc = one(all_docs, "Service", "-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the headless Service selects every xidflow pod that serves metrics
    for kind, suffix in (("Deployment", "-worker"), ("Deployment", "-actuator"), ("DaemonSet", "-probe"),
                         ("Deployment", "-loki-tail")):
        labels = one(all_docs, kind, suffix)["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), suffix


def test_pdbs_select_their_pods(default_docs: list[dict]) -> None:
    for suffix in ("-worker", "-actuator"):
        pdb = one(default_docs, "PodDisruptionBudget", suffix)
        labels = one(default_docs, "Deployment", suffix)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


def _rule_set(rules: list[dict]) -> set[tuple]:
    """RBAC rules as a set of (group, resource, resourceName, verb) grants, order-free."""
    out = set()
    for r in rules:
        for g in r.get("apiGroups", []):
            for res in r.get("resources", []):
                for name in r.get("resourceNames") or ["*"]:
                    for verb in r["verbs"]:
                        out.add((g, res, name, verb))
    return out


def _shipped_rbac(kind: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "actuator.yaml").read_text()) if d]
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1
    return found[0]["rules"]


def test_actuator_clusterrole_equals_deploy_rbac(default_docs: list[dict]) -> None:
    chart = one(default_docs, "ClusterRole", "-actuator")["rules"]
    assert _rule_set(chart) == _rule_set(_shipped_rbac("ClusterRole"))


def test_actuator_role_matches_deploy_rbac(default_docs: list[dict]) -> None:
    chart = _rule_set(one(default_docs, "Role", "-actuator")["rules"])
    shipped = _rule_set(_shipped_rbac("Role"))
    assert shipped <= chart, f"the chart lacks: {shipped - chart}"
    # The only grants the chart adds: the decision API's pending-plan ConfigMap (ApiSettings.plans_configmap).
    assert chart - shipped <= {("", "configmaps", "xidflow-rescue-plans", v) for v in ("get", "update")}


def test_least_privilege(default_docs: list[dict], all_docs: list[dict]) -> None:
    for docs in (default_docs, all_docs):
        grants = set()
        for d in docs:
            if d["kind"] in ("ClusterRole", "Role"):
                grants |= _rule_set(d["rules"])
        assert not [g for g in grants if g[1] == "secrets"], "no component may read Secrets"
        assert not [g for g in grants if g[1] == "nodes" and g[3] in ("delete", "deletecollection", "*")]
        assert not [g for g in grants if "*" in (g[0], g[1], g[3])], "no wildcards"
        bound = {(d["roleRef"]["name"], s["name"]) for d in docs
                 if d["kind"] in ("ClusterRoleBinding", "RoleBinding") for s in d["subjects"]}
        subjects = {s for _, s in bound}
        # only the actuator and Fluent Bit (pod metadata) are bound to any role
        assert subjects == {"rel-xidflow-actuator", "rel-xidflow-fluent-bit"}
        for kind, suffix in (("Deployment", "-worker"), ("DaemonSet", "-probe"), ("Deployment", "-loki-tail")):
            matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
            for d in matches:
                assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    fb = one(default_docs, "ClusterRole", "-fluent-bit")
    assert _rule_set(fb["rules"]) == {("", r, "*", v) for r in ("pods", "namespaces") for v in ("get", "list", "watch")}
    # Pods are evicted, never deleted, unless a namespace is listed for forced deletion (then only there).
    assert not [g for g in grants if g[1] == "pods" and g[3] == "delete"]
    forced = render(**{"actuator.forceDeleteNamespaces[0]": "batch"})
    deleting = [d for d in forced if d["kind"] in ("ClusterRole", "Role")
                and ("", "pods", "*", "delete") in _rule_set(d["rules"])]
    assert [(d["kind"], d["metadata"]["namespace"]) for d in deleting] == [("Role", "batch")]


def test_optional_components(all_docs: list[dict]) -> None:
    loki = container(one(all_docs, "Deployment", "-loki-tail"))
    assert loki["command"] == ["xidflow", "loki-tail"]
    assert "--org-id=gpu-fleet" in loki["args"]
    assert any(a.startswith("--loki-url=http") for a in loki["args"])
    assert any(a.startswith("--query={") for a in loki["args"])
    secret = one(all_docs, "Secret", "-api-tokens")
    lines = secret["stringData"]["tokens"].split()
    assert sorted(lines) == ["ops-portal:change-me", "scheduler:change-me-too"]
    actuator = one(all_docs, "Deployment", "-actuator")
    vols = {v["name"]: v for v in actuator["spec"]["template"]["spec"]["volumes"]}
    assert vols["api-tokens"]["secret"]["secretName"] == secret["metadata"]["name"]
    mount = {m["name"]: m["mountPath"] for m in container(actuator)["volumeMounts"]}["api-tokens"]
    assert env_of(container(actuator))["XIDFLOW_API_TOKEN_FILE"] == mount + "/tokens"
    svc = one(all_docs, "Service", "-api")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    probe = one(all_docs, "DaemonSet", "-probe")
    assert container(probe)["securityContext"]["privileged"] is True
    assert "runtimeClassName" not in probe["spec"]["template"]["spec"]
    assert "--expected-gpus=8" in container(probe)["args"]
    rp = one(all_docs, "RescuePolicy", "ci-xid79")
    assert rp["apiVersion"] == "xidflow.dev/v1alpha1" and rp["spec"]["rules"][0]["codes"] == [79]


def test_existing_secret_is_used_as_is() -> None:
    docs = render(**{"actuator.api.existingSecret": "my-tokens", "actuator.api.tokens.a": "b"})
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-tokens")]
    vols = one(docs, "Deployment", "-actuator")["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in vols}["api-tokens"]["secret"]["secretName"] == "my-tokens"


def test_chart_fluent_bit_config_is_the_standalone_one(default_docs: list[dict]) -> None:
    chart = yaml.safe_load(one(default_docs, "ConfigMap", "-fluent-bit")["data"]["fluent-bit.yaml"])
    standalone = yaml.safe_load((ROOT / "deploy" / "fluent-bit" / "fluent-bit.yaml").read_text())
    for out in standalone["pipeline"]["outputs"]:
        assert out["brokers"] == "${KAFKA_BROKERS}"
        out["brokers"] = "xidflow-kafka-bootstrap.kafka.svc:9092"
    # Both are parsed YAML: same keys and values, regardless of formatting and comments.
    assert json.dumps(chart, sort_keys=True) == json.dumps(standalone, sort_keys=True)


def _fluent_bit_inputs(docs: list[dict]) -> dict[str, dict]:
    config = yaml.safe_load(one(docs, "ConfigMap", "-fluent-bit")["data"]["fluent-bit.yaml"])
    return {i["tag"]: i for i in config["pipeline"]["inputs"]}


def test_fabric_managers_log_is_tailed_where_the_values_say(default_docs: list[dict]) -> None:
    """Default: /var/log/fabricmanager.log, inside the /var/log mount. Elsewhere: its folder is mounted read-only."""
    assert _fluent_bit_inputs(default_docs)["kernel.fabricmanager"]["path"] == "/var/log/fabricmanager.log"
    daemonset = one(default_docs, "DaemonSet", "-fluent-bit")
    assert not [v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "fabricmanager-log"]
    docs = render(**{"fluentBit.fabricManagerLogPath": "/run/nvidia/fm/fabricmanager.log"})
    assert _fluent_bit_inputs(docs)["kernel.fabricmanager"]["path"] == "/run/nvidia/fm/fabricmanager.log"
    daemonset = one(docs, "DaemonSet", "-fluent-bit")
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "fabricmanager-log")
    assert volume["hostPath"]["path"] == "/run/nvidia/fm"
    mount = next(m for m in container(daemonset)["volumeMounts"] if m["name"] == "fabricmanager-log")
    assert (mount["mountPath"], mount["readOnly"]) == ("/run/nvidia/fm", True)


def test_components_can_be_turned_off() -> None:
    docs = render(**{"worker.enabled": False, "probe.enabled": False, "fluentBit.enabled": False,
                     "actuator.enabled": False})
    assert docs == [], [d["kind"] + "/" + d["metadata"]["name"] for d in docs]


# -- Kafka security (issue 12) ----------------------------------------------------------------------
WORKLOADS = (("Deployment", "-worker", "xidflow-worker"), ("Deployment", "-actuator", "xidflow-actuator"),
             ("DaemonSet", "-probe", "xidflow-probe"), ("Deployment", "-loki-tail", "xidflow-loki-tail"))


def test_plaintext_by_default_and_a_signing_key_for_the_actuator(default_docs: list[dict]) -> None:
    for kind, suffix in (("Deployment", "-worker"), ("Deployment", "-actuator"), ("DaemonSet", "-probe")):
        env = env_of(container(one(default_docs, kind, suffix)))
        assert env["KAFKA_SECURITY_PROTOCOL"] == "PLAINTEXT"
        assert not [k for k in env if k.startswith(("KAFKA_SASL", "KAFKA_SSL"))]
    actuator = one(default_docs, "Deployment", "-actuator")
    assert env_of(container(actuator))["XIDFLOW_SIGNING_KEY_FILE"] == "/etc/xidflow/signing/key"
    secret = one(default_docs, "Secret", "-signing")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" and secret["data"]["key"]
    vols = {v["name"]: v for v in actuator["spec"]["template"]["spec"]["volumes"]}
    assert vols["signing"]["secret"]["secretName"] == secret["metadata"]["name"]


def test_sasl_ssl_mounts_each_components_own_secret_and_the_ca() -> None:
    docs = render(KAFKA_SECURITY)
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-signing")]
    for kind, suffix, user in WORKLOADS:
        w = one(docs, kind, suffix)
        c = container(w)
        env = env_of(c)
        assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["KAFKA_SASL_USERNAME"] == user
        assert env["KAFKA_SASL_PASSWORD_FILE"] == "/etc/xidflow/kafka-sasl/password"
        assert env["KAFKA_SSL_CAFILE"] == "/etc/xidflow/kafka-tls/ca.crt"
        assert "KAFKA_SASL_PASSWORD" not in env  # secrets are files, never environment values
        assert env["XIDFLOW_EXTRA_FROM_CONFIGMAP"] == {"configMapKeyRef": {"name": "xidflow-extra", "key": "value",
                                                                           "optional": True}}
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert vols["kafka-sasl"]["secret"]["secretName"] == user
        assert vols["kafka-tls"]["secret"]["secretName"] == "xidflow-cluster-ca-cert"
        assert "extra-ca" in vols
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["kafka-sasl"] == "/etc/xidflow/kafka-sasl" and mounts["extra-ca"] == "/etc/xidflow/extra-ca"
    actuator = container(one(docs, "Deployment", "-actuator"))
    env = env_of(actuator)
    assert env["KAFKA_API_SASL_USERNAME"] == "xidflow-api"
    vols = {v["name"]: v for v in one(docs, "Deployment", "-actuator")["spec"]["template"]["spec"]["volumes"]}
    assert vols["kafka-sasl-api"]["secret"]["secretName"] == "xidflow-api"
    assert vols["signing"]["secret"]["secretName"] == "xidflow-request-signing"


def test_service_account_annotations_for_irsa_and_workload_identity() -> None:
    docs = render(KAFKA_SECURITY)
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/xidflow"}
    for name in ("-actuator", "-probe", "-loki-tail"):
        assert one(docs, "ServiceAccount", name)["metadata"]["annotations"] == irsa
    assert one(docs, "ServiceAccount", "-worker")["metadata"]["annotations"] == {
        **irsa, "iam.gke.io/gcp-service-account": "xidflow-worker@project.iam.gserviceaccount.com"}


def test_sasl_without_a_secret_is_refused_at_render_time() -> None:
    with pytest.raises(Exception, match="kafka.security.sasl.users.worker.existingSecret"):
        render(**{"kafka.security.protocol": "SASL_SSL", "kafka.security.sasl.mechanism": "SCRAM-SHA-512"})


def test_oauthbearer_passes_the_token_source() -> None:
    docs = render(**{"kafka.security.protocol": "SASL_SSL", "kafka.security.sasl.mechanism": "OAUTHBEARER",
                     "kafka.security.sasl.oauth.tokenCommand": "msk-token us-east-1"})
    env = env_of(container(one(docs, "Deployment", "-worker")))
    assert env["KAFKA_SASL_OAUTH_TOKEN_COMMAND"] == "msk-token us-east-1" and "KAFKA_SASL_USERNAME" not in env


def test_fluent_bit_kafka_outputs_get_the_rdkafka_security_properties() -> None:
    docs = render(KAFKA_SECURITY)
    config = yaml.safe_load(one(docs, "ConfigMap", "-fluent-bit")["data"]["fluent-bit.yaml"])
    outputs = [o for o in config["pipeline"]["outputs"] if o["name"] == "kafka"]
    assert len(outputs) == 2
    for out in outputs:
        assert out["rdkafka.security.protocol"] == "sasl_ssl" and out["rdkafka.sasl.mechanisms"] == "SCRAM-SHA-512"
        assert out["rdkafka.sasl.username"] == "xidflow-shipper"
        assert out["rdkafka.sasl.password"] == "${KAFKA_SASL_PASSWORD}"
        assert out["rdkafka.ssl.ca.location"] == "/etc/xidflow/kafka-tls/ca.crt"
        assert out["rdkafka.request.required.acks"] == -1  # the rest of the output is untouched
    ds = one(docs, "DaemonSet", "-fluent-bit")
    env = env_of(container(ds))
    assert env["KAFKA_SASL_PASSWORD"] == {"secretKeyRef": {"name": "xidflow-shipper", "key": "password"}}
    assert "kafka-tls" in {m["name"] for m in container(ds)["volumeMounts"]}


def test_an_incomplete_sasl_setup_renders_and_is_left_to_the_process_to_refuse() -> None:
    docs = render(**{"kafka.security.protocol": "SASL_SSL"})  # the process names KAFKA_SASL_MECHANISM at start
    env = env_of(container(one(docs, "Deployment", "-worker")))
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and "KAFKA_SASL_MECHANISM" not in env


def test_loki_tail_authenticates_with_mounted_secret_files() -> None:
    from click.testing import CliRunner

    from pipeline.cli import cli

    docs = render(**{"lokiTail.enabled": True, "lokiTail.url": "https://loki-gateway.monitoring.svc",
                     "lokiTail.auth.existingSecret": "loki-creds", "lokiTail.auth.bearerTokenKey": "token",
                     "lokiTail.auth.caKey": "ca.crt"})
    workload = one(docs, "Deployment", "-loki-tail")
    c = container(workload)
    assert "--bearer-token-file=/etc/xidflow/loki-auth/token" in c["args"]
    assert "--ca-file=/etc/xidflow/loki-auth/ca.crt" in c["args"]
    assert not [a for a in c["args"] if a.startswith(("--username", "--password-file"))]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "loki-auth")
    assert mount == {"name": "loki-auth", "mountPath": "/etc/xidflow/loki-auth", "readOnly": True}
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "loki-auth")
    assert volume["secret"]["secretName"] == "loki-creds"
    assert not [e for e in c["env"] if "TOKEN" in e["name"] or "PASSWORD" in e["name"]]  # files, not env
    # every rendered flag is one the command really has
    flags = {a.split("=", 1)[0] for a in c["args"]}
    help_text = CliRunner().invoke(cli, ["loki-tail", "--help"]).output
    assert all(f in help_text for f in flags), flags

    basic = render(**{"lokiTail.enabled": True, "lokiTail.auth.existingSecret": "loki-creds",
                      "lokiTail.auth.username": "xidflow", "lokiTail.auth.passwordKey": "password"})
    args = container(one(basic, "Deployment", "-loki-tail"))["args"]
    assert {"--username=xidflow", "--password-file=/etc/xidflow/loki-auth/password"} <= set(args)


@pytest.mark.parametrize(("values", "message"), [
    ({"lokiTail.auth.passwordKey": "password", "lokiTail.auth.existingSecret": "s"}, "needs lokiTail.auth.username"),
    ({"lokiTail.auth.bearerTokenKey": "token"}, "existingSecret, which is empty"),
    ({"lokiTail.auth.existingSecret": "s", "lokiTail.auth.username": "u", "lokiTail.auth.passwordKey": "p",
      "lokiTail.auth.bearerTokenKey": "t"}, "not both"),
])
def test_loki_tail_auth_mistakes_are_refused_with_the_value_named(values: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(**{"lokiTail.enabled": True, **values})
