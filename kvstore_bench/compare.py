"""`kvstore-bench compare`: store and load through kvstore and its peers, same blocks.

Systems, each in its usual per-node deployment on this machine:

  kvstore       a `kvstore serve` daemon; the client maps its shared-memory
                region and copies in and out itself (gRPC on a unix socket
                for control only).
  redis         `redis-server` (OS package), unix socket, no persistence;
                redis-py, pipelined.
  lmcache-mp    LMCache's per-node MP server (`lmcache server`, CPU L1) and
                its engine-driven shared-memory transfer path.
  lmcache-cpu   LMCache's in-process CPU engine (LocalCPUBackend).
  lmcache-local, lmcache-kvstore, lmcache-redis
                a whole LMCacheEngine storing and retrieving the same chunks:
                CPU tier only; kvstore as its remote backend (kvstore_connectors/lmcache);
                LMCache's own Redis connector. Not in the default set (--systems).
  mooncake      Mooncake Store: mooncake_master + a holder client that mounts
                the memory segment + the measured client (tcp on loopback,
                registered buffers, batch_put_from / batch_get_into).

Every system is measured by kvstore_bench/compare_worker.py in a subprocess (in the
system's own virtual environment where it needs one), with the same blocks
(same seed), and a memcpy of the same bytes timed in that process just before.
The figures that matter are ratios: op time vs memcpy time, and kvstore vs the
best peer. The goal: kvstore loads >= 3x the best peer at 2 MiB blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore_bench import _common
from kvstore_bench.ports import free_port

DEFAULT_SYSTEMS = ("kvstore", "redis", "lmcache-mp", "lmcache-cpu", "mooncake")
# LMCache + kvstore against LMCache alone and LMCache + Redis (docs/lmcache.md)
LMCACHE_ENGINE_SYSTEMS = ("lmcache-local", "lmcache-kvstore", "lmcache-redis")
SYSTEMS = DEFAULT_SYSTEMS + LMCACHE_ENGINE_SYSTEMS
WORKER = Path(__file__).resolve().parent / "compare_worker.py"
START_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, of {','.join(SYSTEMS)}",
    )
    p.add_argument("--block-sizes", default="65536,2097152", help="bytes, comma-separated")
    p.add_argument("--total-bytes", type=int, default=256 << 20, help="bytes per store/load batch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--latency-ops", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="32 MiB batches, 3 repeats, 10 latency ops")
    p.add_argument("--results", default="results", help="results folder")


def _wait_for(check, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def _service(
    system: str, tmp: Path, capacity_bytes: int, no_delete_bytes: int = 0
) -> Iterator[dict[str, Any]]:
    """Start what `system` needs on this node; yield the worker's parameters."""
    procs: list[subprocess.Popen] = []
    log = open(tmp / f"{system}.log", "wb")  # noqa: SIM115 - closed below
    try:
        if system in LMCACHE_ENGINE_SYSTEMS:
            py = _common.env_python("lmcache")
            if not py:
                raise RuntimeError("no .venv-lmcache: run bash kvstore_bench/setup_peers.sh")
            params = {"python": py, "capacity_bytes": capacity_bytes}
            if system == "lmcache-kvstore":
                with _service("kvstore", tmp, capacity_bytes) as svc:
                    yield {**svc, **params}
            elif system == "lmcache-redis":
                exe = shutil.which("redis-server")
                if not exe:
                    raise RuntimeError("redis-server not installed (apt-get install redis-server)")
                port = free_port()
                procs.append(
                    subprocess.Popen(
                        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no", "--maxmemory", str(capacity_bytes * 2),
                         "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip
                _wait_for(
                    lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None,
                    "redis-server",
                    procs[0],
                )
                yield {**params, "redis_port": port}
            else:
                yield params
        elif system == "kvstore":
            sock = tmp / "kvstore.sock"
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvstore",
                        "serve",
                        "--set",
                        f"server.socket_path={sock}",
                        "--set",
                        "server.tcp_address=",
                        "--set",
                        "metrics.address=",
                        "--set",
                        f"dram.capacity_bytes={capacity_bytes}",
                        "--set",
                        f"dram.path=/dev/shm/kvsbench-{os.getpid()}.dram",
                        "--set",
                        "node_id=compare",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=_common.repo_root(),
                )
            )
            _wait_for(lambda: sock.exists(), "kvstore daemon", procs[0])
            time.sleep(0.5)
            yield {"address": f"unix:{sock}", "python": sys.executable}
        elif system == "redis":
            exe = shutil.which("redis-server")
            if not exe:
                raise RuntimeError("redis-server not installed (apt-get install redis-server)")
            sock = tmp / "redis.sock"
            procs.append(
                subprocess.Popen(
                    [
                        exe,
                        "--port",
                        "0",
                        "--unixsocket",
                        str(sock),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--maxmemory",
                        str(capacity_bytes * 2),
                        "--dir",
                        str(tmp),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            _wait_for(lambda: sock.exists(), "redis-server", procs[0])
            yield {"unix_socket": str(sock), "python": sys.executable}
        elif system == "mooncake":
            py = _common.env_python("mooncake")
            if not py:
                raise RuntimeError("no .venv-mooncake: run bash kvstore_bench/setup_peers.sh")
            rpc, http = free_port(), free_port()
            master = str(Path(py).parent / "mooncake_master")
            env = dict(
                os.environ,
                MC_TCP_BIND_ADDRESS="127.0.0.1",
                MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER="16384",
                MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER="16384",
            )
            procs.append(
                subprocess.Popen(
                    [
                        master,
                        "--rpc_address=127.0.0.1",
                        f"--rpc_port={rpc}",
                        "--enable_http_metadata_server=true",
                        "--http_metadata_server_host=127.0.0.1",
                        f"--http_metadata_server_port={http}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
            _wait_for(
                lambda: socket.create_connection(("127.0.0.1", rpc), 1).close() is None,
                "mooncake_master",
                procs[0],
            )
            params = {
                "metadata_url": f"http://127.0.0.1:{http}/metadata",
                "master_address": f"127.0.0.1:{rpc}",
                "python": py,
                "env": env,
            }
            holder = subprocess.Popen(
                [
                    py,
                    str(WORKER),
                    json.dumps(
                        {
                            **params,
                            "role": "mooncake-holder",
                            "segment_bytes": capacity_bytes * 2,
                            "env": None,
                        }
                    ),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
            procs.append(holder)
            line = holder.stdout.readline() if holder.stdout else b""
            if not json.loads(line or b"{}").get("ready"):
                raise RuntimeError(f"mooncake holder failed: {line!r}")
            yield params
        elif system in ("lmcache-mp", "lmcache-cpu"):
            py = _common.env_python("lmcache")
            if not py:
                raise RuntimeError("no .venv-lmcache: run bash kvstore_bench/setup_peers.sh")
            params: dict[str, Any] = {"python": py, "capacity_bytes": no_delete_bytes}
            if system == "lmcache-mp":
                port, http = free_port(), free_port()
                lmcache_exe = str(Path(py).parent / "lmcache")
                procs.append(
                    subprocess.Popen(
                        [
                            lmcache_exe,
                            "server",
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                            "--http-port",
                            str(http),
                            "--l1-size-gb",
                            f"{max(1.0, no_delete_bytes / 2**30):.2f}",
                            "--eviction-policy",
                            "LRU",
                            "--shm-name",
                            f"kvsbench{os.getpid()}",
                            "--disable-observability",
                            "--supported-transfer-mode",
                            "engine_driven",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                _wait_for(
                    lambda: (
                        urllib.request.urlopen(f"http://127.0.0.1:{http}/config", timeout=1).status
                        == 200
                    ),
                    "lmcache server",
                    procs[0],
                )
                params.update(url=f"tcp://127.0.0.1:{port}", http_url=f"http://127.0.0.1:{http}")
            yield params
        else:
            raise ValueError(f"unknown system {system!r}")
    finally:
        for proc in reversed(procs):
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            _stop(proc)
        log.close()
        # The daemon keeps its region (and manifest) for a restart; a benchmark does not.
        for f in Path("/dev/shm").glob(f"kvsbench-{os.getpid()}.dram*"):
            with contextlib.suppress(OSError):
                f.unlink()


def _run_worker(params: dict[str, Any]) -> dict[str, Any]:
    py = params.pop("python")
    env = params.pop("env", None) or dict(os.environ)
    env["PYTHONPATH"] = str(_common.repo_root()) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(
            [py, str(WORKER), json.dumps(params)],
            capture_output=True,
            timeout=WORKER_TIMEOUT_S,
            env=env,
            cwd=_common.repo_root(),
        )
    except subprocess.TimeoutExpired:
        # This block size's error only: the system's other sizes keep their results.
        return {
            "system": params["system"],
            "block_bytes": params["block_bytes"],
            "error": f"worker did not finish in {WORKER_TIMEOUT_S:.0f} s",
        }
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or b"").decode(errors="replace")[-800:]
    return {
        "system": params["system"],
        "block_bytes": params["block_bytes"],
        "error": f"worker rc={proc.returncode}: {tail}",
    }


def run(args: argparse.Namespace) -> int:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        print(f"unknown systems: {sorted(unknown)}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.block_sizes.split(",")]
    total = 32 << 20 if args.quick else args.total_bytes
    repeats = 3 if args.quick else args.repeats
    latency_ops = 10 if args.quick else args.latency_ops
    out_dir = _common.results_dir(args.results, "compare")
    results: list[dict[str, Any]] = []
    progress = _common.Progress(len(systems) * len(sizes), "compare")
    with tempfile.TemporaryDirectory(prefix="kvsbench-") as tmp_name:
        tmp = Path(tmp_name)
        for system in systems:
            try:
                # LMCache's SDK path has no delete: its L1 holds every round, so
                # stores never wait on its (asynchronous) eviction.
                no_delete = total * (repeats + 2) * len(sizes) + (256 << 20)
                with _service(system, tmp, total * 2 + (64 << 20), no_delete) as svc:
                    for bb in sizes:
                        params = {
                            **svc,
                            "system": system,
                            "block_bytes": bb,
                            "n_blocks": max(1, total // bb),
                            "repeats": repeats,
                            "latency_ops": latency_ops,
                            "seed": args.seed,
                        }
                        res = _run_worker(params)
                        results.append(res)
                        progress.update(1, system)
                        _print_row(res)
            except Exception as exc:  # a peer that cannot start is reported, not fatal
                for bb in sizes:
                    results.append(
                        {
                            "system": system,
                            "block_bytes": bb,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
                    _print_row(results[-1])
                progress.update(len(sizes), system)
    progress.close()
    summary = summarize(results)
    _common.write_json(
        out_dir / "compare.json", {"results": results, "summary": summary, "settings": vars(args)}
    )
    from kvstore_bench import report

    md = report.compare_report(
        results, summary, out_dir, command="kvstore-bench " + " ".join(sys.argv[1:])
    )
    print(md)
    print(f"results in {out_dir}")
    return 0


def _print_row(res: dict[str, Any]) -> None:
    if "error" in res:
        print(
            f"  {res['system']:<12} {res['block_bytes']:>9} B  ERROR {res['error'][:300]}",
            file=sys.stderr,
        )
        return
    nbytes = res["block_bytes"] * res["n_blocks"]
    print(
        f"  {res['system']:<12} {res['block_bytes']:>9} B  "
        f"store {_common.gbps(nbytes, res['store']['median_s']):6.2f} GB/s  "
        f"load {_common.gbps(nbytes, res['load']['median_s']):6.2f} GB/s  "
        f"memcpy {_common.gbps(nbytes, res['memcpy']['median_s']):6.2f} GB/s",
        file=sys.stderr,
    )


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per block size: each system's store/load speed as a share of its memcpy,
    and kvstore's load speed over the best peer's."""
    out: dict[str, Any] = {}
    for bb in sorted({r["block_bytes"] for r in results}):
        rows = {r["system"]: r for r in results if r["block_bytes"] == bb and "error" not in r}
        per = {
            name: {
                "store_vs_memcpy": r["memcpy"]["median_s"] / r["store"]["median_s"],
                "load_vs_memcpy": r["memcpy"]["median_s"] / r["load"]["median_s"],
                "load_one_p50_s": r["load_one"]["median_s"],
                "load_one_p99_s": r["load_one"]["p99_s"],
                "store_one_p50_s": r["store_one"]["median_s"],
            }
            for name, r in rows.items()
        }
        entry: dict[str, Any] = {"systems": per}
        # lmcache-kvstore is kvstore behind LMCache: not a peer of kvstore.
        peers = {k: v for k, v in per.items() if k not in ("kvstore", "lmcache-kvstore")}
        if "kvstore" in per and peers:
            best = max(peers, key=lambda k: peers[k]["load_vs_memcpy"])
            entry["best_peer_load"] = best
            entry["kvstore_load_over_best_peer"] = (
                per["kvstore"]["load_vs_memcpy"] / peers[best]["load_vs_memcpy"]
            )
            services = {k: v for k, v in peers.items() if k not in ("lmcache-cpu", "lmcache-local")}
            if services:
                # Peers that, like kvstore, serve the node from another process.
                best_svc = max(services, key=lambda k: services[k]["load_vs_memcpy"])
                entry["best_service_peer_load"] = best_svc
                entry["kvstore_load_over_best_service_peer"] = (
                    per["kvstore"]["load_vs_memcpy"] / services[best_svc]["load_vs_memcpy"]
                )
            best_s = max(peers, key=lambda k: peers[k]["store_vs_memcpy"])
            entry["best_peer_store"] = best_s
            entry["kvstore_store_over_best_peer"] = (
                per["kvstore"]["store_vs_memcpy"] / peers[best_s]["store_vs_memcpy"]
            )
        if "lmcache-kvstore" in per:
            # What an LMCache user sees: the same engine with kvstore behind it,
            # against LMCache alone and LMCache with Redis behind it.
            mine = per["lmcache-kvstore"]
            entry["lmcache_kvstore_over"] = {
                other: {
                    "load": mine["load_vs_memcpy"] / per[other]["load_vs_memcpy"],
                    "store": mine["store_vs_memcpy"] / per[other]["store_vs_memcpy"],
                }
                for other in ("lmcache-local", "lmcache-redis")
                if other in per
            }
        out[str(bb)] = entry
    return out
