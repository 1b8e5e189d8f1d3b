"""The deployment files, checked by the real validators; the daemon under systemd's protocol.

- every step of deploy/validate.sh passes on the files as they are, and each
  one fails on a copy of deploy/ with one typical mistake put in;
- a real daemon started with NOTIFY_SOCKET (a datagram socket this test binds,
  as systemd's manager does) sends READY=1 only once its gRPC port answers
  grpc.health.v1, pings WATCHDOG=1 at half of WATCHDOG_USEC, and sends
  STOPPING=1 on SIGTERM before it exits 0;
- a live daemon's /metrics, after real traffic, passes `promtool check metrics`
  and exports every metric the Grafana dashboard queries.
"""

from __future__ import annotations

import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.namespace import NamespaceSpec
from kvstore.process import DaemonProcess
from kvstore_bench.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
STORE_SERVICE = "kvstore.v1.StoreService"

# validate.sh step -> what it needs besides python3 (a missing tool skips here;
# validate.sh itself, which CI runs, fails instead).
STEP_TOOLS = {
    "systemd": ["systemd-analyze", "kvstore"],
    "render": ["helm_python"],
    "yaml": ["helm_python", "yamllint"],
    "kubernetes": ["helm_python", "kubernetes-validate"],
    "same": ["helm_python"],
    "configs": ["helm_python"],
    "dashboard": ["promtool"],
    "metrics": ["promtool"],
}


def _missing(tools: list[str]) -> list[str]:
    missing = []
    for tool in tools:
        if tool == "helm_python":
            if importlib.util.find_spec("helm_python") is None:
                missing.append("helm-python-sdk (pip)")
        elif shutil.which(tool) is None:
            missing.append(tool)
    return missing


def _validate(step: str, deploy_dir: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    missing = _missing(STEP_TOOLS[step])
    if missing:
        pytest.skip(f"validate.sh {step} needs {', '.join(missing)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(deploy_dir / "validate.sh"), step],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=deploy_dir.parent,
    )


@pytest.mark.parametrize("step", list(STEP_TOOLS))
def test_validate_step_passes(step: str) -> None:
    proc = _validate(step)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"all 1 steps passed ({step})" in proc.stdout


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


# step, file under deploy/, text replaced, replacement, what the failure must say
MISTAKES = [
    ("systemd", "systemd/kvstored.service", "WatchdogSec=", "WatchdogSecs=", "Unknown key"),
    (
        "systemd",
        "systemd/kvstore-indexer.service",
        "Type=notify",
        "Type=notifyy",
        "Failed to parse",
    ),
    (
        "render",
        "helm/kvstore/values.yaml",
        "  hostNetwork: true",
        "  hostNetwrk: true",
        "hostNetwrk",
    ),
    (
        "render",
        "helm/kvstore/templates/node-service.yaml",
        "{{ .Values.ports.grpc }}",
        '{{ required "ports.grcp is not set" .Values.ports.grcp }}',
        "ports.grcp is not set",
    ),
    (
        "yaml",
        "kubernetes/node-service.yaml",
        "  clusterIP: None\n",
        "  clusterIP: None   \n",
        "trailing",
    ),
    (
        "kubernetes",
        "kubernetes/node-daemonset.yaml",
        "      hostIPC: true\n",
        "      hostIPC: true\n      hostIpc: true\n",
        "hostIpc",
    ),
    (
        "same",
        "kubernetes/node-daemonset.yaml",
        "failureThreshold: 120",
        "failureThreshold: 12",
        "120",
    ),
    (
        "configs",
        "kubernetes/node-configmap.yaml",
        'capacity_bytes = "32GiB"',
        "capacity_byte = 1",
        "capacity_byte",
    ),
    (
        "configs",
        "kubernetes/node-daemonset.yaml",
        "name: KVSTORE_NODE_ID",
        "name: KVSTORE_NODEID",
        "nodeid",
    ),
    ("configs", "systemd/kvstore.toml", "[leases]", "[lease]", "lease"),
    (
        "configs",
        "systemd/router.toml",
        "decision_deadline_s = 0.05",
        "decision_deadline = 0.05",
        "decision_deadline",
    ),
    (
        "render",
        "helm/kvstore/values.yaml",
        "  backends: {}\n",
        "  backends: {}\n  backend: {}\n",
        "backend",
    ),
    (
        "dashboard",
        "grafana/kvstore-dashboard.json",
        "sum by (method) (",
        "sum by method (",
        "parse",
    ),
    (
        "metrics",
        "grafana/kvstore-dashboard.json",
        "kvstore_tier_pinned_blocks",
        "kvstore_tier_pined_blocks",
        "pined",
    ),
]


@pytest.mark.parametrize(
    ("step", "relpath", "old", "new", "expect"),
    MISTAKES,
    ids=[f"{m[0]}:{m[1].rsplit('/', 1)[-1]}:{m[3][:16]}" for m in MISTAKES],
)
def test_validate_step_catches_a_mistake(
    tmp_path: Path, step: str, relpath: str, old: str, new: str, expect: str
) -> None:
    deploy_copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy_copy, ignore=shutil.ignore_patterns("__pycache__"))
    _edit(deploy_copy / relpath, old, new)
    proc = _validate(step, deploy_copy)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "FAIL" in output
    assert expect.lower() in output.lower(), output


# ---------------------------------------------------------------- notify protocol


def _health(address: str, service: str, timeout_s: float) -> int:
    """The health status, or -1 when the port does not answer within timeout_s."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return -1
        return int(reply.status)


def _recv_messages(sock: socket.socket, timeout_s: float) -> list[dict[str, str]]:
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(4096).decode()
    except TimeoutError:
        return []
    return [dict(line.split("=", 1) for line in data.splitlines() if line)]


def _notify_command(kind: str, tmp_path: Path, tcp_address: str) -> tuple[list[str], str]:
    """The process under test and the gRPC service its readiness probe asks for."""
    if kind == "daemon":
        # 256 MiB pre-faulted takes a noticeable moment: a READY sent before
        # the server is up would be caught in that window.
        daemon = DaemonProcess(
            tmp_path / "d", dram_bytes=256 << 20, settings={"server.tcp_address": tcp_address}
        )
        return daemon.command(), STORE_SERVICE
    return (
        [sys.executable, "-m", "kvstore", "indexer", "--address", tcp_address],
        "kvstore.v1.IndexerService",
    )


@pytest.mark.parametrize("kind", ["daemon", "indexer"])
def test_notify_ready_after_grpc_answers_then_watchdog_and_stopping(
    tmp_path: Path, kind: str
) -> None:
    """What systemd sees of kvstored.service / kvstore-indexer.service (Type=notify)."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    tcp_address = f"127.0.0.1:{free_port()}"
    cmd, service = _notify_command(kind, tmp_path, tcp_address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="1000000")
    log_path = tmp_path / f"{kind}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, text=True)
    try:
        received: list[dict[str, str]] = []
        deadline = time.monotonic() + 60
        ready_at_health = None
        while time.monotonic() < deadline and proc.poll() is None:
            for msg in _recv_messages(notify, 0.05):
                received.append(msg)
                if msg.get("READY") == "1":
                    # At the moment READY arrives the port must already answer.
                    ready_at_health = (
                        _health(tcp_address, "", 2.0),
                        _health(tcp_address, service, 2.0),
                    )
            if ready_at_health is not None:
                break
        assert proc.poll() is None, log_path.read_text()
        assert ready_at_health is not None, f"no READY=1 within 60 s; got {received}"
        serving = health_pb2.HealthCheckResponse.SERVING
        assert ready_at_health == (serving, serving)

        # Watchdog armed at 1 s: pings every 0.5 s, from the running process.
        watch_until = time.monotonic() + 1.8
        while time.monotonic() < watch_until:
            received += _recv_messages(notify, 0.1)
        pings = [m for m in received if m.get("WATCHDOG") == "1"]
        assert len(pings) >= 2, received
        assert sum(1 for m in received if m.get("READY") == "1") == 1, received

        proc.send_signal(signal.SIGTERM)
        stop_deadline = time.monotonic() + 10
        stopping = False
        while time.monotonic() < stop_deadline and not stopping:
            stopping = any(m.get("STOPPING") == "1" for m in _recv_messages(notify, 0.1))
        assert stopping, "no STOPPING=1 after SIGTERM"
        assert proc.wait(timeout=20) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        notify.close()
        if kind == "daemon":  # it ran outside DaemonProcess: remove its region here
            DaemonProcess(tmp_path / "d").remove_region()


def test_daemon_without_notify_socket_sends_nothing_and_serves(tmp_path: Path) -> None:
    """No NOTIFY_SOCKET (run by hand, in Kubernetes): the protocol stays silent."""
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["WATCHDOG_USEC"] = "1000000"  # armed but nowhere to send: no error either
    with DaemonProcess(tmp_path / "d", env=env) as daemon:
        assert _health(daemon.tcp_address, STORE_SERVICE, 5.0) == 1
        assert daemon.stop() == 0


def test_daemon_refuses_a_malformed_notify_socket(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["NOTIFY_SOCKET"] = "relative/notify.sock"
    cmd = DaemonProcess(tmp_path / "d").command()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "NOTIFY_SOCKET must be an absolute path" in proc.stderr


# ---------------------------------------------------------------- metrics


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt: prometheus)")
def test_live_metrics_pass_promtool_and_cover_the_dashboard(tmp_path: Path) -> None:
    # Peers on (no NIXL needed): the dashboard's peer-transfer row queries them.
    peers = {"peer.enabled": True, "peer.secret": "test-only", "peer.transport": "grpc_stream"}
    with DaemonProcess(tmp_path / "d", metrics=True, settings=peers) as daemon:
        block_bytes = 4096
        spec = NamespaceSpec(
            model="tiny",
            dtype="float16",
            block_size_tokens=16,
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            block_bytes=block_bytes,
        )
        with Client(daemon.address) as client:
            ns = client.declare_namespace(spec)
            hashes = list(range(1, 33))
            blocks = np.random.default_rng(0).integers(0, 256, (32, block_bytes), dtype=np.uint8)
            assert client.put(ns, hashes, blocks).stored == 32
            got = client.get(ns, hashes)
            assert got.found == 32
            assert np.array_equal(np.asarray(got.data).reshape(32, block_bytes), blocks)
            assert client.lookup(ns, [*hashes[:8], 10**6]).prefix_blocks == 8
        url = f"http://{daemon.metrics_address}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "kvstore_store_blocks_total" in text
    # the indexer's /metrics (its freshness row on the dashboard)
    from kvstore.indexer.config import IndexerConfig
    from kvstore.indexer.metrics import serve_metrics
    from kvstore.indexer.service import Indexer
    from kvstore.indexer.subscriber import SourceSpec

    # one source (never reachable): the per-source series carry a sample
    ix = Indexer(IndexerConfig(sources=[SourceSpec(node="probe", endpoint="tcp://127.0.0.1:1")]))
    ix.start()
    try:
        deadline = time.monotonic() + 10
        while not ix.subscriber.source_status():
            assert time.monotonic() < deadline, "the indexer never took its source up"
            time.sleep(0.02)
        server, port = serve_metrics(ix, "127.0.0.1:0")
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            indexer_text = urllib.request.urlopen(url, timeout=10).read().decode()
        finally:
            server.shutdown()
    finally:
        ix.close()
    assert "kvstore_indexer_up" in indexer_text
    lint = subprocess.run(
        ["promtool", "check", "metrics"],
        input=indexer_text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (
        lint.stdout + lint.stderr
    )
    # Each process's page is linted as Prometheus scrapes it: on its own. Both
    # export kvstore_denied_requests_total (the audit counter), so the two pages
    # joined would repeat its HELP line; joined only for the dashboard's names.
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (
        lint.stdout + lint.stderr
    )
    text += indexer_text
    metrics_file = tmp_path / "metrics.txt"
    metrics_file.write_text(text)
    names = subprocess.run(
        [
            sys.executable,
            str(DEPLOY / "checks.py"),
            "metric-names",
            str(DEPLOY / "grafana" / "kvstore-dashboard.json"),
            str(metrics_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert names.returncode == 0, names.stderr


# ---------------------------------------------------------------- register sidecar


def _start_indexer(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    log = open(tmp_path / "indexer.log", "w")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.indexer", "--address", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if "listening on" in line:
                return proc, line.rsplit(" ", 1)[-1].strip()
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"indexer did not start: {(tmp_path / 'indexer.log').read_text()}")


def test_register_sidecar_keeps_the_node_in_the_indexer_until_stopped(tmp_path: Path) -> None:
    """The DaemonSet's register sidecar, against a real indexer and daemon on loopback."""
    from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

    events_port, replay_port = free_port(), free_port()
    indexer, indexer_address = _start_indexer(tmp_path)
    register = None
    try:
        with DaemonProcess(
            tmp_path / "d",
            name="node-a",
            settings={
                "events.enabled": "true",
                "events.publish_address": f"tcp://127.0.0.1:{events_port}",
                "events.replay_address": f"tcp://127.0.0.1:{replay_port}",
            },
        ) as daemon:
            env = dict(os.environ)
            env.update(
                NODE_ID="node-a",
                POD_IP="127.0.0.1",
                INDEXER_ADDRESS=indexer_address,
                EVENTS_PORT=str(events_port),
                REPLAY_PORT=str(replay_port),
                TTL_S="3",
            )
            register = subprocess.Popen(
                [sys.executable, str(DEPLOY / "helm" / "kvstore" / "files" / "register.py")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            with grpc.insecure_channel(indexer_address) as channel:
                stub = indexer_pb2_grpc.IndexerServiceStub(channel)

                def sources() -> dict[str, indexer_pb2.NodeInfo]:
                    reply = stub.ListNodes(indexer_pb2.ListNodesRequest(), timeout=5)
                    return {s.source.node: s for s in reply.sources}

                deadline = time.monotonic() + 20
                while "node-a" not in sources() and time.monotonic() < deadline:
                    time.sleep(0.1)
                info = sources()["node-a"]
                assert info.registered
                assert info.source.endpoint == f"tcp://127.0.0.1:{events_port}"
                assert info.source.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"

                # Blocks stored on the node reach the indexer through the
                # registered stream: the routing path works end to end.
                hashes = list(range(100, 116))
                spec = NamespaceSpec(
                    model="tiny",
                    dtype="float16",
                    block_size_tokens=16,
                    num_layers=2,
                    num_kv_heads=2,
                    head_dim=16,
                    block_bytes=4096,
                )
                with Client(daemon.address) as client:
                    ns = client.declare_namespace(spec)
                    client.put(ns, hashes, np.zeros((16, 4096), dtype=np.uint8))
                request = indexer_pb2.ScoreRequest(
                    model="tiny", block_hashes=np.asarray(hashes, dtype="<u8").tobytes()
                )
                prefix = 0
                deadline = time.monotonic() + 20
                while prefix != 16 and time.monotonic() < deadline:
                    scores = stub.Score(request, timeout=5).scores
                    prefix = next((s.prefix_blocks for s in scores if s.node == "node-a"), 0)
                    time.sleep(0.1)
                assert prefix == 16

                # Renewed well inside the TTL: still there after more than one TTL.
                time.sleep(4.0)
                assert "node-a" in sources()

                register.send_signal(signal.SIGTERM)
                assert register.wait(timeout=15) == 0
                assert "node-a" not in sources(), "SIGTERM should withdraw the registration"
    finally:
        if register is not None and register.poll() is None:
            register.kill()
            register.wait(timeout=10)
        indexer.send_signal(signal.SIGTERM)
        try:
            indexer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            indexer.kill()
            indexer.wait(timeout=10)


def test_register_sidecar_refuses_a_bad_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_ID", "POD_IP")}
    proc = subprocess.run(
        [sys.executable, str(DEPLOY / "helm" / "kvstore" / "files" / "register.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "bad environment" in proc.stderr and "NODE_ID" in proc.stderr
