"""Writes deploy/prometheus-rule.yaml: the rules of onecard-rules.yaml, word for word, as a
PrometheusRule for the Prometheus Operator. tests/unit/test_alert_rules.py fails when the
file is not what this writes.

    python3 deploy/prometheus/make_prometheus_rule.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "onecard-rules.yaml"
TARGET = HERE.parent / "prometheus-rule.yaml"

HEADER = """\
# onecard's alerting rules as a PrometheusRule, for clusters that run the Prometheus Operator
# (kube-prometheus-stack and the like):
#
#   kubectl apply -f deploy/prometheus-rule.yaml
#
# The operator loads the rules that its Prometheus's `ruleSelector` selects: kube-prometheus-stack
# selects `release: <its release name>` by default, so add that label below (or install the stack
# with prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false). Kept apart from
# kubernetes.yaml: a cluster without the operator has no PrometheusRule kind, and applying the
# unit must not fail there.
#
# Generated from deploy/prometheus/onecard-rules.yaml (the rules, word for word) by
#   python3 deploy/prometheus/make_prometheus_rule.py
# Edit the rules there, not here. Docs: docs/operations.md, "Alerts".
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the PromQL) as literal blocks, as they are written in the rules file."""


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def render() -> str:
    rules = yaml.safe_load(RULES.read_text())
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "onecard", "namespace": "onecard", "labels": {"app.kubernetes.io/name": "onecard"}},
           "spec": {"groups": rules["groups"]}}
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}", file=sys.stderr)
