"""infra/k8s/ holds what a cluster needs to stop API pods without dropping calls: every
Deployment has a PodDisruptionBudget, the API drains in preStop within its grace period, and
the autoscaler scales a Deployment that exists on the metric /metrics exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MANIFESTS = Path(__file__).resolve().parent.parent / "infra" / "k8s"


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def test_every_deployment_has_a_disruption_budget_selecting_its_pods() -> None:
    budgets = [d["spec"]["selector"]["matchLabels"] for d in of_kind("PodDisruptionBudget")]
    for deployment in of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert any(b.items() <= labels.items() for b in budgets), deployment["metadata"]["name"]


def test_the_api_drains_in_prestop_within_its_grace_period() -> None:
    (api,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "voice-agent-api"]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in command
    env = {e["name"]: e.get("value") for e in container["env"]}
    # README, Stopping: DRAIN_TIMEOUT_S plus about 20 s under the grace period.
    assert float(env["DRAIN_TIMEOUT_S"]) + 20 <= pod["terminationGracePeriodSeconds"]
    assert env["FORWARDED_ALLOW_IPS"]


def test_the_autoscaler_scales_the_api_on_the_exported_live_calls_gauge() -> None:
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    names = {d["metadata"]["name"] for d in of_kind(target["kind"])}
    assert target["name"] in names
    (metric,) = hpa["spec"]["metrics"]
    health = (Path(__file__).resolve().parent.parent / "app" / "http" / "health.py").read_text()
    assert f'"{metric["pods"]["metric"]["name"]}"' in health
