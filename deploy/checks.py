"""Offline checks of the deployment files that no packaged validator covers.

Called by deploy/validate.sh; each subcommand exits non-zero with the reason:

    render OUT_DIR      lint the Helm chart (Helm's own linter, strict) and render
                        it for every scenario in SCENARIOS into OUT_DIR/<name>.yaml,
                        with Helm v4's engine (the helm-python-sdk wheel binds
                        Helm's Go SDK; no helm binary is packaged for Debian)
    same RENDERED       the chart's default render and deploy/kubernetes/ hold the
                        same objects (labels Helm owns and checksum annotations
                        aside; TOML compared parsed)
    configs FILE...     every kvstore TOML, standalone or inside a ConfigMap of
                        the given manifests (one set), loads in `kvstore
                        serve|indexer|router --print-config` with the env of the
                        containers that mount it (unknown keys are errors there)
    dashboard FILE RULES_OUT
                        the Grafana dashboard is well formed; its queries, with
                        Grafana's variables filled in, go to RULES_OUT as a
                        Prometheus rule file for `promtool check rules` (PromQL parser)
    metric-names DASHBOARD METRICS_FILE
                        every metric the dashboard queries is exported by a live
                        daemon (METRICS_FILE: a scrape of its /metrics)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
CHART = DEPLOY / "helm" / "kvstore"
PLAIN = DEPLOY / "kubernetes"
RELEASE = "kvstore"
NAMESPACE = "kvstore"
# Plain manifests that the chart does not render, on purpose: Helm does not
# own the namespace it installs into, and the engine pod is the user's.
PLAIN_ONLY = {("Namespace", "kvstore"), ("Pod", "vllm-engine")}
HELM_OWNED_LABELS = {"app.kubernetes.io/managed-by", "helm.sh/chart"}

# Value sets rendered and validated; "default" must equal deploy/kubernetes/.
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "redis-ha": {
        "indexer": {"backend": "redis", "replicas": 3, "redis": {"url": "redis://redis:6379/0"}},
    },
    "redis-secret": {
        "indexer": {
            "backend": "redis",
            "replicas": 2,
            "redis": {"existingSecret": "kvstore-redis"},
        },
    },
    "peer-servicemonitor-podnet": {
        "node": {
            "hostNetwork": False,
            "diskDir": "",
            "config": {"peer": {"enabled": True}},
            "priorityClassName": "system-node-critical",
        },
        "metrics": {"podAnnotations": False, "serviceMonitor": {"enabled": True}},
        "imagePullSecrets": [{"name": "registry"}],
    },
    "router": {
        "router": {
            "enabled": True,
            "replicas": 2,
            "backends": {
                "gpu-node-1": "http://gpu-node-1.example.internal:8000",
                "gpu-node-2": "http://gpu-node-2.example.internal:8000",
            },
            "config": {"strategy": "cache+load", "decision_deadline_s": 0.05},
        },
    },
    "custom-ports": {
        "ports": {
            "grpc": 60051,
            "metrics": 9500,
            "events": 6557,
            "replay": 6558,
            "indexerGrpc": 60061,
        },
    },
}


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def render(out_dir: Path) -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE)
    findings = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    if findings or report.get("errors"):
        fail(f"helm lint {CHART}: {findings or report['errors']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with helm.Chart.load(str(CHART)) as chart:
        for name, values in SCENARIOS.items():
            try:
                chart.validate_schema(values)
                manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
            except helm.HelmError as exc:
                fail(f"helm render of scenario {name!r}: {exc}")
            docs = []
            for source, text in sorted(manifests.items()):
                if source.endswith(".yaml") and text.strip():
                    docs.append(f"# Source: {source}\n{text.strip()}\n")
            (out_dir / f"{name}.yaml").write_text("".join(docs))
            print(f"rendered {name}: {len(docs)} templates, helm {helm.helm_sdk_version()}")


def _objects(paths: list[Path]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            if key in out:
                fail(f"{path}: {key} defined twice")
            out[key] = doc
    return out


def _normalise(obj: Any, path: str = "") -> Any:
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if key == "labels" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in HELM_OWNED_LABELS}
            if key == "annotations" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if not k.startswith("checksum/")}
                if not value:
                    continue
            if isinstance(value, str) and key.endswith(".toml"):
                value = tomllib.loads(value)
            out[key] = _normalise(value, f"{path}.{key}")
        return out
    if isinstance(obj, list):
        return [_normalise(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a:
                out.append(f"{path}.{key}: only in the chart's render")
            elif key not in b:
                out.append(f"{path}.{key}: only in deploy/kubernetes")
            else:
                _diff(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: deploy/kubernetes has {a!r}, the chart renders {b!r}")


def same(rendered: Path) -> None:
    plain = _objects(sorted(PLAIN.glob("*.yaml")))
    chart = _objects([rendered])
    problems: list[str] = []
    for key in sorted(set(plain) | set(chart)):
        if key in PLAIN_ONLY:
            continue
        if key not in chart:
            problems.append(f"{key}: in deploy/kubernetes, not rendered by the chart")
        elif key not in plain:
            problems.append(f"{key}: rendered by the chart, missing from deploy/kubernetes")
        else:
            _diff(_normalise(plain[key]), _normalise(chart[key]), f"{key[0]}/{key[1]}", problems)
    if problems:
        fail("deploy/kubernetes and the chart differ:\n  " + "\n  ".join(problems))
    print(f"deploy/kubernetes matches the chart's default render ({len(chart)} objects)")


def _kvstore_print_config(
    argv: list[str], toml_text: str, origin: str, pod_env: dict[str, str] | None = None
) -> None:
    """Run ``kvstore ARGV... --print-config`` with ``--config`` pointing at the TOML."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    pod_env = {k: v for k, v in (pod_env or {}).items() if k.startswith("KVSTORE_")}
    env.update(pod_env)
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(toml_text)
        f.flush()
        cmd = [sys.executable, "-m", "kvstore", argv[0], "--config", f.name, *argv[1:]]
        proc = subprocess.run(
            [*cmd, "--print-config"], capture_output=True, text=True, env=env, timeout=60
        )
    if proc.returncode != 0:
        fail(
            f"{origin}: `kvstore {' '.join(argv)} --print-config` refused it: {proc.stderr.strip()}"
        )
    print(f"config ok: {origin} (kvstore {' '.join(argv)}, env {sorted(pod_env)})")


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The env a container would get; values from the API become placeholders.

    Checking the config with the pod's env catches a misspelt KVSTORE_ variable
    (an unknown field) and a field that only the env completes (peer.secret).
    """
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = _expand(item["value"], env)
        else:
            value = f"placeholder-{item['name'].lower()}"
        env[item["name"]] = value
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _consumers(docs: list[dict[str, Any]]) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """ConfigMap name -> [(kvstore argv without --config FILE, env)] of each container mounting it."""
    out: dict[str, list[tuple[list[str], dict[str, str]]]] = {}
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec") if "template" in spec else spec
        if not pod or "containers" not in pod:
            continue
        volumes = {
            v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v
        }
        for container in pod["containers"]:
            args = list(container.get("args", []))
            if container.get("command") != ["kvstore"] or "--config" not in args:
                continue
            at = args.index("--config")
            env = _container_env(container)
            argv = [_expand(a, env) for a in args[:at] + args[at + 2 :]]
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes:
                    out.setdefault(volumes[mount["name"]], []).append((argv, env))
    return out


def configs(paths: list[Path]) -> None:
    """TOML files are checked alone; YAML files together form one set of manifests."""
    checked = 0
    docs: list[tuple[Path, dict[str, Any]]] = []
    for path in paths:
        if path.suffix == ".toml":
            command = next((c for c in ("indexer", "router") if c in path.name), "serve")
            _kvstore_print_config([command], path.read_text(), str(path))
            checked += 1
        else:
            docs.extend((path, d) for d in yaml.safe_load_all(path.read_text()) if d)
    consumers = _consumers([d for _, d in docs])
    for path, doc in docs:
        if doc.get("kind") != "ConfigMap":
            continue
        name = doc["metadata"]["name"]
        for key, text in (doc.get("data") or {}).items():
            if not key.endswith(".toml"):
                continue
            users = consumers.get(name)
            if not users:
                fail(f"{path}: no kvstore container mounts ConfigMap {name}")
            for argv, env in users:
                _kvstore_print_config(argv, text, f"{path.name} {name}/{key}", env)
                checked += 1
    if not checked:
        fail(f"no kvstore config found in {[str(p) for p in paths]}")


# Grafana variables -> values Prometheus accepts, so promtool can parse the queries.
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "instance": ".*"}


def dashboard(path: Path, rules_out: Path) -> None:
    board = json.loads(path.read_text())
    for key in ("title", "uid", "panels", "schemaVersion", "templating"):
        if key not in board:
            fail(f"{path}: no {key!r}")
    ids = [p["id"] for p in board["panels"]]
    if len(ids) != len(set(ids)):
        fail(f"{path}: duplicate panel ids {ids}")
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        if panel.get("type") == "row":
            continue
        for key in ("title", "type", "gridPos", "datasource", "targets"):
            if key not in panel:
                fail(f"{path}: panel {panel.get('id')} has no {key!r}")
        for target in panel["targets"]:
            expr = target.get("expr", "")
            if not expr:
                fail(f"{path}: panel {panel['title']!r} has a target without expr")
            for var in re.findall(r"\$\{?(\w+)", expr):
                if var not in variables and var not in GRAFANA_VARIABLES:
                    fail(f"{path}: panel {panel['title']!r} uses undefined ${var}")
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                fail(f"{path}: panel {panel['title']!r}: unbalanced expr {expr!r}")
    rules = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VARIABLES[m.group(1)], target["expr"])
            rules.append(
                {"record": f"dashboard:panel{panel['id']}:{target['refId']}", "expr": expr}
            )
    rules_out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    print(f"dashboard ok: {len(board['panels'])} panels, {len(rules)} queries")


def _queried_metrics(board: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            names.update(re.findall(r"\bkvstore_[a-z0-9_]+", target.get("expr", "")))
    for var in board["templating"]["list"]:
        names.update(re.findall(r"\bkvstore_[a-z0-9_]+", json.dumps(var.get("query", ""))))
    return names


def metric_names(dashboard_path: Path, metrics_path: Path) -> None:
    board = json.loads(dashboard_path.read_text())
    exported = set()
    for line in metrics_path.read_text().splitlines():
        if line and not line.startswith("#"):
            exported.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    if not exported:
        fail(f"{metrics_path}: no samples")
    missing = sorted(n for n in _queried_metrics(board) if n not in exported)
    if missing:
        fail(f"{dashboard_path} queries metrics the daemon does not export: {missing}")
    print(f"dashboard metrics ok: {len(_queried_metrics(board))} names, all exported")


def main(argv: list[str]) -> None:
    if not argv:
        fail(__doc__ or "usage")
    command, args = argv[0], [Path(a) for a in argv[1:]]
    if command == "render" and len(args) == 1:
        render(args[0])
    elif command == "same" and len(args) == 1:
        same(args[0])
    elif command == "configs" and args:
        configs(args)
    elif command == "dashboard" and len(args) == 2:
        dashboard(args[0], args[1])
    elif command == "metric-names" and len(args) == 2:
        metric_names(args[0], args[1])
    else:
        fail(f"bad arguments: {argv}\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
