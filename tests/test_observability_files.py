"""The Grafana dashboard and Prometheus rules in infra/observability/ use only metrics the
service exports, and the rules file has the shape Prometheus loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import running_service
from tests.metrics_support import samples

HERE = Path(__file__).resolve().parent.parent / "infra" / "observability"
DASHBOARD = HERE / "grafana" / "voice-agent.json"
RULES = HERE / "prometheus" / "voice-agent.rules.yml"
METRIC = re.compile(r"\bvoice_agent_[a-z0-9_]+\b")
# What the issue asks the rules to watch, by the metric each one reads.
ALERTED = {
    "voice_agent_operations_unknown",
    "voice_agent_reconciliation_failures_total",
    "voice_agent_delivery_oldest_waiting_seconds",
    "voice_agent_events_dropped_total",
    "voice_agent_calls_rejected_busy_total",
}


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text("utf-8"))
    return [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text("utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


async def exported(url: str) -> set[str]:
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    names = {key.split("{", 1)[0] for key in samples(response.text)}
    # A family with no series yet (no call live, nothing observed) still declares its type.
    series = {
        "gauge": ("",),
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
    }
    for family, kind in re.findall(r"^# TYPE (\S+) (\w+)$", response.text, re.M):
        names |= {family + suffix for suffix in series.get(kind, ("",))}
    return names


async def test_every_metric_the_dashboard_and_the_rules_use_is_exported(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        names = await exported(service.url)
    used = {m for e in dashboard_exprs() + [r["expr"] for r in rules()] for m in METRIC.findall(e)}
    assert used, "no metric found in the dashboard or the rules"
    assert used - names == set(), f"not exported: {sorted(used - names)}"
    assert ALERTED <= {m for r in rules() for m in METRIC.findall(r["expr"])}


def test_the_rules_file_has_prometheus_rule_file_shape() -> None:
    doc = yaml.safe_load(RULES.read_text("utf-8"))
    assert set(doc) == {"groups"}
    group_names = [g["name"] for g in doc["groups"]]
    assert len(group_names) == len(set(group_names))
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert isinstance(rule["alert"], str) and re.fullmatch(r"[A-Za-z_]\w*", rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smhdwy]", str(rule.get("for", "0m"))), rule
            assert rule["labels"]["severity"] in {"page", "warn"}
            assert "summary" in rule["annotations"]
    assert any("10m" == r.get("for") for r in rules() if "operations_unknown" in r["expr"])
    # The real checker, where it is installed (it parses every PromQL expression too).
    promtool = shutil.which("promtool")
    if promtool:
        done = subprocess.run(
            [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_is_grafana_json_with_one_prometheus_datasource() -> None:
    board = json.loads(DASHBOARD.read_text("utf-8"))
    ids = [p["id"] for p in board["panels"]]
    assert board["uid"] and len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


COMPOSE = HERE.parent / "compose.yaml"


def test_the_compose_observe_profile_wires_collector_jaeger_prometheus_and_grafana() -> None:
    compose = yaml.safe_load(COMPOSE.read_text("utf-8"))
    services = compose["services"]
    observe = {name for name, s in services.items() if "observe" in s.get("profiles", [])}
    assert observe == {"otel-collector", "jaeger", "prometheus", "grafana"}
    # Every file the profile mounts is in the repository.
    for name in observe:
        for volume in services[name].get("volumes", []):
            source = volume.split(":")[0]
            assert (COMPOSE.parent / source).is_file(), f"{name} mounts missing {source}"
    # The collector's pipeline names only what it declares, and sends to Jaeger's OTLP port.
    collector = yaml.safe_load((HERE / "otel-collector.yaml").read_text("utf-8"))
    pipeline = collector["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(collector[kind]), kind
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    # The services pass the OTLP endpoint through; the worker serves its own /metrics where
    # Prometheus looks for it, and Prometheus loads the rules file where it is mounted.
    for name in ("api-1", "api-2", "worker"):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in services[name]["environment"], name
    prom = yaml.safe_load((HERE / "prometheus" / "prometheus.yml").read_text("utf-8"))
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    serve_targets = jobs["voice-agent-serve"]["static_configs"][0]["targets"]
    assert {t.split(":")[0] for t in serve_targets} == {"api-1", "api-2"}
    [workers] = jobs["voice-agent-worker"]["dns_sd_configs"]
    assert workers["names"] == ["worker"]
    assert services["worker"]["environment"]["METRICS_BIND"].endswith(f":{workers['port']}")
    mounted = [v.split(":")[1] for v in services["prometheus"]["volumes"]]
    assert set(prom["rule_files"]) <= set(mounted)
    # Grafana loads the dashboard from where it is mounted, over the provisioned Prometheus.
    dashboards = yaml.safe_load((HERE / "grafana/provisioning/dashboards.yaml").read_text())
    folder = dashboards["providers"][0]["options"]["path"]
    assert any(
        v.split(":")[1] == f"{folder}/voice-agent.json" for v in services["grafana"]["volumes"]
    )
    sources = yaml.safe_load((HERE / "grafana/provisioning/datasources.yaml").read_text())
    assert {s["type"] for s in sources["datasources"]} == {"prometheus", "jaeger"}
