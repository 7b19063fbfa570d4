"""The alerting rules (deploy/prometheus/onecard-rules.yaml): valid for promtool, each alert
covered by promtool unit tests where it fires and where it stays quiet, the PrometheusRule
manifest the same rules word for word, and every runbook link a section of the docs."""

from __future__ import annotations

import importlib.util
import re

import yaml

from tests.harness import ROOT
from tests.prometheus_server import promtool

RULES = ROOT / "deploy" / "prometheus" / "onecard-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "onecard-rules.test.yaml"
MANIFEST = ROOT / "deploy" / "prometheus-rule.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}


def test_promtool_accepts_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout + done.stderr


def test_promtool_unit_tests_pass():
    done = promtool("test", "rules", str(RULE_TESTS), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_quiet():
    fires: set[str] = set()
    quiet: set[str] = set()
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerts())
    assert names - fires == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"
    assert (fires | quiet) - names == set(), "tests of alerts that do not exist"


def test_every_alert_says_how_bad_what_and_where_to_read_more():
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page, anchor = notes["runbook"].split("#")
        assert page == "docs/operations.md" and anchor == name.lower() and anchor in headings, name


def _generator():
    spec = importlib.util.spec_from_file_location("make_prometheus_rule",
                                                  ROOT / "deploy" / "prometheus" / "make_prometheus_rule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_prometheus_rule_manifest_is_the_rules_file():
    text = MANIFEST.read_text()
    assert text == _generator().render(), "run: python3 deploy/prometheus/make_prometheus_rule.py"
    doc = yaml.safe_load(text)
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    unit = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text())
                if d["kind"] == "Deployment")
    assert doc["metadata"]["namespace"] == unit["metadata"]["namespace"]
