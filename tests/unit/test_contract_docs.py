"""The contract pages of docs/ against the code: the generated ones are fresh, the hand-written ones say what the
code does (pipeline.runtime.contractdocs)."""

from __future__ import annotations

import ast
import dataclasses
import re
from datetime import UTC, datetime
from pathlib import Path

import orjson

from pipeline.runtime import contractdocs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_the_generated_contract_files_are_fresh() -> None:
    stale = [str(path.relative_to(ROOT)) for path, data in contractdocs.rendered().items()
             if not path.exists() or path.read_bytes() != data]
    assert not stale, f"stale: {stale}; run `python -m pipeline.runtime.contractdocs` and commit the result"


def _backticked_first_cells(page: str) -> set[str]:
    return {m for m in re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)}


# -- the decision API ----------------------------------------------------------------------------------------
def test_the_decision_api_page_says_what_the_openapi_document_says() -> None:
    from pipeline.actuator.requests import MAX_ACTIONS, RESCUE_ACTION_NAMES

    page = (DOCS / "decision-api.md").read_text()
    document = orjson.loads(contractdocs.OPENAPI.read_bytes())
    assert "(openapi/decision-api.json)" in page
    body = document["components"]["schemas"]["RescueActionBody"]
    assert set(body["properties"]) <= _backticked_first_cells(page), "every body field has a row"
    post = document["paths"]["/api/v1/rescue-actions"]["post"]
    documented = set(re.findall(r"^\| (\d{3}) \|", page, flags=re.M))
    assert documented == set(post["responses"]), "every answer of the document has a row, and no other"
    for header in [p["name"] for p in post["parameters"]] + ["X-Request-Id", "Authorization"]:
        assert f"`{header}`" in page, header
    said = re.search(r"The actions a request may name: (.*?)\. They", page, flags=re.S)
    assert said and re.findall(r"`(\w+)`", said.group(1)) == list(RESCUE_ACTION_NAMES)
    assert f"1 to {MAX_ACTIONS}" in page


def test_the_decision_api_pages_example_is_a_request() -> None:
    from pipeline.actuator.requests import RescueActionRequest, parse_rescue_request

    page = (DOCS / "decision-api.md").read_text()
    body = re.search(r"<<'EOF'\n(.*?)\nEOF", page, flags=re.S)
    assert body is not None
    got = parse_rescue_request(body.group(1), received_at=datetime.now(UTC), requested_by="ops",
                               idempotency_key="ticket-4711")
    assert isinstance(got, RescueActionRequest), got


# -- request signing -----------------------------------------------------------------------------------------
def test_the_signing_pages_example_and_recipe_are_what_the_actuator_checks() -> None:
    from pipeline.actuator import signing

    page = (DOCS / "request-signing.md").read_text()
    example = dict(re.findall(r"^(key \(the secret\)|record key|record value|header):\s+(.+)$", page, flags=re.M))
    secret, key, value = (example[k].encode() for k in ("key (the secret)", "record key", "record value"))
    name, header = signing.sign(secret, key, value)
    assert example["header"] == f"{name}: {header.decode()}"
    assert signing.verify([secret], key, value, [(name, header)]) is None
    # The page's Python recipe computes the same header.
    recipe = re.search(r"```python\n(.*?)```", page, flags=re.S)
    assert recipe is not None
    scope: dict[str, object] = {}
    exec(recipe.group(1), scope)  # noqa: S102 - the page's own example code
    assert scope["signature"](secret, key, value) == header  # type: ignore[operator]
    domain = signing._DOMAIN.rstrip(b"\x00").decode()
    assert f"`{domain}` and one NUL byte" in page and f"{signing.SIGNATURE_HEADER}: v1=" in page


# -- the node ledger -----------------------------------------------------------------------------------------
def test_the_ledger_refuses_a_field_the_page_does_not_name() -> None:
    import pytest

    from pipeline.actuator.ownership import Ledger

    ledger = Ledger()
    ledger.set_flow_value("f", "boot_id_before", "b", 1.0)
    ledger.set_flow_value("f", "checkpoint:drain#2", {"at": 1.0, "until": 2.0}, 1.0)
    with pytest.raises(ValueError, match="FLOW_FIELDS"):
        ledger.set_flow_value("f", "undocumented", 1, 1.0)


def test_every_field_a_flow_entry_gets_is_on_the_page() -> None:
    """What the ledger's own functions write into a flow entry (not only its values) is documented."""
    from pipeline.actuator.ownership import FLOW_FIELDS, Ledger

    ledger = Ledger()
    ledger.flow("f", 1.0)
    ledger.open_flow("f", {"rec": {}, "rule": "r", "esc": False, "steps": []}, 1.0)
    ledger.claim("f", "drain", "w", 1.0)
    ledger.mark_done("f", "cordon", 1.0)
    ledger.record_applied("f", "cordon", {"by": "w", "at": 1.0, "outcome": "applied", "reason": ""}, 1.0)
    ledger.cancel("f", "manual-uncordon", 1.0)
    ledger.finish("f", "done", 2.0)
    written = set(orjson.loads(ledger.to_annotation())["flows"]["f"])
    assert written <= set(FLOW_FIELDS), written - set(FLOW_FIELDS)
    page = (DOCS / "node-ledger.md").read_text()
    assert set(FLOW_FIELDS) <= _backticked_first_cells(page)


# -- the audit record -----------------------------------------------------------------------------------------
def _detail_keys_in_the_actuator() -> dict[str, str]:
    """Keys the actuator's code writes into an audit record's ``details``, as literals: ``details=`` arguments,
    a ``StepResult``'s third argument, and what is assigned, merged or returned into a name ending in
    ``details`` (key -> where)."""
    found: dict[str, str] = {}

    def literal_keys(node: ast.AST | None) -> list[str]:
        if isinstance(node, ast.Dict):
            return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        if isinstance(node, ast.BinOp):
            return literal_keys(node.left) + literal_keys(node.right)
        return []

    def named_details(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id.endswith("details")

    for path in sorted((ROOT / "pipeline" / "actuator").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            keys: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith("details"):
                keys += [k for r in ast.walk(node) if isinstance(r, ast.Return) for k in literal_keys(r.value)]
            elif isinstance(node, ast.Call):
                keys += [k for kw in node.keywords if kw.arg == "details" for k in literal_keys(kw.value)]
                if isinstance(node.func, ast.Name) and node.func.id == "StepResult" and len(node.args) >= 3:
                    keys += literal_keys(node.args[2])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                    if named_details(target):
                        keys += literal_keys(node.value)
                    elif (isinstance(target, ast.Subscript) and named_details(target.value)
                          and isinstance(target.slice, ast.Constant)):
                        keys.append(target.slice.value)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr) and named_details(node.left):
                keys += literal_keys(node.right)
            for key in keys:
                found.setdefault(key, f"{where}:{getattr(node, 'lineno', 0)}")
    return found


def test_every_details_key_the_actuator_writes_is_documented() -> None:
    from pipeline.actuator.audit import AUDIT_DETAILS
    from pipeline.actuator.plan import UndoPlan
    from pipeline.actuator.workload import DETAILS_KEY

    written = _detail_keys_in_the_actuator()
    assert len(written) > 30 and "notified" in written, "the scan finds the actuator's details"
    undocumented = {k: at for k, at in written.items()
                    if k not in AUDIT_DETAILS and k != DETAILS_KEY
                    and k not in {f.name for f in dataclasses.fields(UndoPlan)}}
    assert not undocumented, f"add them to pipeline.actuator.audit.AUDIT_DETAILS: {undocumented}"
    page = (DOCS / "audit.md").read_text()
    assert set(AUDIT_DETAILS) <= _backticked_first_cells(page)


def test_every_audit_action_the_actuator_writes_is_a_step_or_documented() -> None:
    from pipeline.actuator.actions import ACTION_NAMES
    from pipeline.actuator.fleetmetrics import AUDIT_ACTIONS

    written: set[str] = set()
    for path in (ROOT / "pipeline" / "actuator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("_audit", "_audit_now"):
                for arg in node.args:
                    written |= {c.value for c in ast.walk(arg) if isinstance(c, ast.Constant)
                                and isinstance(c.value, str) and c.value.islower() and " " not in c.value}
            if name == "make_record":
                written |= {kw.value.value for kw in node.keywords if kw.arg == "action"
                            and isinstance(kw.value, ast.Constant)}
    assert {"decide", "undo", "breaker-trip"} <= written
    assert written <= set(AUDIT_ACTIONS) | set(ACTION_NAMES), written - set(AUDIT_ACTIONS) - set(ACTION_NAMES)


# -- metrics -------------------------------------------------------------------------------------------------
def test_the_readmes_metrics_table_names_what_the_processes_export() -> None:
    """deploy/README.md explains each metric in prose; it may not name one that is not exported, nor miss one."""
    from pipeline.runtime import metrics

    exported = {contractdocs._exposed_name(m) for ms in metrics.COMPONENT_METRICS.values() for m in ms}
    readme = (ROOT / "deploy" / "README.md").read_text()
    table = readme.split("## Metrics (contract)", 1)[1].split("\n## ", 1)[0]
    named = {n for row in re.findall(r"^\| (`xidflow_[^|]+)\|", table, flags=re.M)
             for n in re.findall(r"`(xidflow_\w+)`", row)}
    assert named == exported, {"in the README only": named - exported, "missing there": exported - named}
    assert set(re.findall(r"`(xidflow_\w+)`", (DOCS / "metrics.md").read_text())) >= exported
