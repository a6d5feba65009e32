"""xidflow's alerting rules: valid (promtool check rules), behaving as specified (promtool test rules),
built on metrics that exist, and embedded unchanged in the chart's PrometheusRule.

promtool comes from Debian's `prometheus` package (`make test` installs it: `xidflow local install --promtool`).
Without it these tests fail: they never skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "xidflow-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "xidflow-rules.test.yaml"
CHART = ROOT / "deploy" / "helm" / "xidflow"

REQUIRED_ALERTS = {
    "XidflowBreakerOpen", "XidflowRemediationFailures", "XidflowFlowStuckPastTimeout", "XidflowConsumerLagGrowing",
    "XidflowDeadLettersRising", "XidflowDetectionLatencyHigh", "XidflowWorkerAbsent", "XidflowActuatorAbsent",
    "XidflowPartitionHeldUndecodable", "XidflowUndecodableBatchSkipped",
}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed (xidflow local install --promtool, or Debian: apt-get install prometheus)"
    return path


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_check_rules() -> None:
    proc = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_promtool_test_rules() -> None:
    proc = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                          cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_required_alert_exists_and_is_tested() -> None:
    names = {r["alert"] for r in rules()}
    assert REQUIRED_ALERTS <= names
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert names <= tested, f"alerts never seen firing in a test: {names - tested}"
    for r in rules():
        assert r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]


METRIC_DECL = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"([a-z0-9_]+)\"")


def _exported_metric_names() -> set[str]:
    """Every series name the code declares (read from the source: registries may be per process)."""
    names = set()
    for path in (ROOT / "pipeline").rglob("*.py"):
        for kind, name in METRIC_DECL.findall(path.read_text()):
            names.add(name)
            if kind == "Counter":
                names.add(name if name.endswith("_total") else name + "_total")
            if kind in ("Histogram", "Summary"):
                names |= {name + "_bucket", name + "_sum", name + "_count"}
    assert "xidflow_breaker_open" in names, "metric declarations not found"
    return names


def test_rules_use_only_metrics_xidflow_exports() -> None:
    exported = _exported_metric_names()
    used = set()
    for r in rules():
        used |= set(re.findall(r"\b(xidflow_[a-z0-9_]+)", r["expr"]))
    assert used, "the rules use no xidflow metric"
    assert used <= exported, f"not exported by any xidflow process: {sorted(used - exported)}"


def test_chart_prometheusrule_embeds_the_rules_file() -> None:
    from pipeline.localinfra.helm import helm_template

    text = helm_template(CHART, release="rel", namespace="xf", set_values={"metrics.prometheusRule.enabled": True},
                         log=lambda _m: None)
    docs = [d for d in yaml.safe_load_all(text) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    assert rule["metadata"]["namespace"] == "xf"
    off = helm_template(CHART, release="rel", namespace="xf", log=lambda _m: None)
    assert "PrometheusRule" not in off


def test_plain_rules_file_is_the_chart_file() -> None:
    assert RULES.is_symlink() and RULES.resolve() == (CHART / "files" / "xidflow-rules.yaml").resolve()
