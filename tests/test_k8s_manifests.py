"""infra/k8s/ holds what a cluster needs to stop API pods without dropping calls: every
Deployment has a PodDisruptionBudget, the API drains in preStop within its grace period, and
the autoscaler scales a Deployment that exists on the metric /metrics exports. The SIP edge
(Kamailio and rtpengine) runs on the host network with a dispatcher list that follows the API
pods, and Kamailio and rtpengine themselves accept the configuration the manifests give them."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
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


# --- the SIP edge: Kamailio and rtpengine (infra/k8s/voice-agent-edge.yaml) ----------------

INFRA = MANIFESTS.parent
CONFIG_FILES = {
    "kamailio.cfg": INFRA / "kamailio" / "kamailio.cfg",
    "rtpengine.conf": INFRA / "rtpengine" / "rtpengine.conf",
}


def edge() -> dict[str, Any]:
    (daemonset,) = [d for d in of_kind("DaemonSet") if d["metadata"]["name"] == "voice-agent-edge"]
    return daemonset


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["template"]["spec"]["containers"]}


def defines(args: list[str]) -> dict[str, str]:
    """Kamailio's `-A NAME[=value]` arguments."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg == "-A":
            name, _, value = args[i + 1].partition("=")
            found[name] = value
    return found


def options(args: list[str]) -> dict[str, list[str]]:
    """rtpengine's `--name=value` arguments (a name may repeat)."""
    found: dict[str, list[str]] = {}
    for arg in args:
        name, _, value = arg.removeprefix("--").partition("=")
        found.setdefault(name, []).append(value)
    return found


def test_the_sip_edge_runs_kamailio_with_rtpengine_on_the_host_network() -> None:
    daemonset = edge()
    pod = daemonset["spec"]["template"]["spec"]
    parts = containers(daemonset)
    kamailio, rtpengine = parts["kamailio"], parts["rtpengine"]
    found = defines(kamailio["args"])
    rtp = options(rtpengine["args"])

    # Host networking: the RTP range and SIP port are the node's, at the address in the SDP.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {(p["containerPort"], p["protocol"]) for p in kamailio["ports"]} == {
        (5060, "UDP"),
        (5060, "TCP"),
    }
    # Kamailio drives this rtpengine: the define on, its control socket where rtpengine listens.
    assert "WITH_RTPENGINE" in found
    assert found["RTPENGINE_SOCK"].strip('"') == "udp:" + rtp["listen-ng"][0]
    assert "direction=external direction=internal" in found["RTPENGINE_OFFER_FLAGS"]
    assert {i.split("/")[0] for i in rtp["interface"]} == {"internal", "external"}
    assert 1024 < int(rtp["port-min"][0]) < int(rtp["port-max"][0]) <= 65535
    # Both read the repository's files, mounted from the ConfigMap made of them.
    mounted = [kamailio["args"][kamailio["args"].index("-f") + 1], rtp["config-file"][0]]
    assert sorted(Path(m).name for m in mounted) == sorted(CONFIG_FILES)
    assert all(path.is_file() for path in CONFIG_FILES.values())


def test_the_dispatcher_list_follows_the_api_pods_sip_listeners() -> None:
    (service,) = [d for d in of_kind("Service") if d["metadata"]["name"] == "voice-agent-sip"]
    (api,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "voice-agent-api"]
    (container,) = api["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    port_names = {
        p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in container["ports"]
    }
    sync = " ".join(containers(edge())["dispatcher-sync"]["args"])

    # Headless, selecting the API pods, on their SIP ports.
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    )
    for port in service["spec"]["ports"]:
        assert port_names[port["targetPort"]] == (port["port"], port["protocol"])
    # The sidecar writes that name's addresses as set 1 (the set kamailio.cfg dispatches to).
    assert "voice-agent-sip.$POD_NAMESPACE" in sync and "1 sip:" in sync
    assert "dispatcher.reload" in sync
    # The pods listen where the list points and trust the edge as their proxy.
    assert env["SIP_BIND"]["value"].endswith(":5060")
    assert env["SIP_ADVERTISED_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SIP_TRUSTED_PROXIES"]["value"] and env["SIP_ALLOW_FROM"]["value"]


@pytest.mark.skipif(shutil.which("kamailio") is None, reason="kamailio is not installed")
@pytest.mark.parametrize("layout", ["loopback cluster", "kubernetes edge"])
def test_kamailio_accepts_its_configuration_with_and_without_rtpengine(
    layout: str, tmp_path: Path
) -> None:
    dispatcher = INFRA / "kamailio" / "dispatcher.list"
    args = ["-A", f'DISPATCHER_LIST="{dispatcher}"']
    if layout == "kubernetes edge":
        args = []
        # The DaemonSet's own defines, with the node's address and paths of this machine.
        found = defines(containers(edge())["kamailio"]["args"])
        found["DISPATCHER_LIST"] = f'"{dispatcher}"'
        found["CTL_SOCK"] = f'"unix:{tmp_path / "ctl"}"'
        for name, value in found.items():
            value = value.replace("$(NODE_IP)", "127.0.0.1")
            args += ["-A", f"{name}={value}" if value else name]
    result = subprocess.run(
        ["kamailio", "-c", "-f", str(CONFIG_FILES["kamailio.cfg"]), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.skipif(shutil.which("rtpengine") is None, reason="rtpengine is not installed")
def test_rtpengine_starts_on_its_configuration_and_answers_kamailio_s_control_protocol() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        ng_port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [
            "rtpengine",
            f"--config-file={CONFIG_FILES['rtpengine.conf']}",
            f"--listen-ng=127.0.0.1:{ng_port}",
            "--interface=internal/127.0.0.1",
            "--interface=external/127.0.0.1!203.0.113.10",
            "--port-min=39000",
            "--port-max=39099",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        offer = _ng(ng_port, b"offer", _OFFER_FROM_THE_TRUNK)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    # The trunk's offer (external -> internal) reaches the replica naming rtpengine's internal
    # address and a port of the configured range, in place of the trunk's media address.
    assert b"result2:ok" in offer, stderr[-2000:]
    sdp = offer.split(b"sdp", 1)[1].decode(errors="replace")
    assert "c=IN IP4 127.0.0.1" in sdp and "198.51.100.7" not in sdp
    port = int(sdp.split("m=audio ", 1)[1].split(" ", 1)[0])
    assert 39000 <= port <= 39099


_OFFER_FROM_THE_TRUNK = (
    "v=0\r\no=- 1 1 IN IP4 198.51.100.7\r\ns=-\r\nc=IN IP4 198.51.100.7\r\nt=0 0\r\n"
    "m=audio 40000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
    "a=rtpmap:101 telephone-event/8000\r\n"
)


def _bencode(value: object) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return str(len(value)).encode() + b":" + value
    if isinstance(value, list):
        return b"l" + b"".join(_bencode(v) for v in value) + b"e"
    assert isinstance(value, dict)
    items = sorted(value.items())
    return b"d" + b"".join(_bencode(k) + _bencode(v) for k, v in items) + b"e"


def _ng(port: int, command: bytes, sdp: str) -> bytes:
    """One `ng` request as Kamailio's rtpengine module sends it (retried until it answers)."""
    message = {
        "command": command.decode(),
        "call-id": "edge-test",
        "from-tag": "trunk",
        "sdp": sdp,
        "direction": ["external", "internal"],
        "replace": ["origin", "session-connection"],
    }
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.2)
        for _ in range(50):  # it takes a moment to start
            sock.sendto(b"cookie1 " + _bencode(message), ("127.0.0.1", port))
            try:
                return sock.recv(65536).removeprefix(b"cookie1 ")
            except TimeoutError:
                continue
    raise TimeoutError("rtpengine did not answer")
