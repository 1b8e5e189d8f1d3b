"""A NIXL peer in its own process, driven by JSON lines on stdin/stdout.

Tests keep NIXL out of the pytest process (a process that created a UCX
backend segfaults at exit) and drive one of these per peer. The region is a
file under /dev/shm mapped MAP_SHARED, so the test maps the same file and
checks bytes independently of NIXL.

Commands (one JSON object per line; one JSON reply per line):
  {"op": "add_peer", "metadata": hex}             -> {"name": str}
  {"op": "remove_peer", "name": str}              -> {}
  {"op": "read", "peer": str, "remote_base": int, "remote_offsets": [...],
   "local_offsets": [...], "sizes": [...], "timeout_s": float}
                                                  -> {"elapsed_s": float}
  {"op": "exit"}                                  -> {} then os._exit(0)
Errors reply {"error": class name, "message": str}. On start it prints
{"name", "metadata", "base", "nbytes"}.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.transfer.base import ReadBatch
from kvstore.transfer.nixl_agent import NixlAgent, ProgressPump


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_RDWR)
    nbytes = os.fstat(fd).st_size
    region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    os.close(fd)
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data
    agent = NixlAgent(name)
    agent.register_region(base, nbytes)
    pump = ProgressPump(agent)
    pump.hold(0, 3600.0)  # tests measure the transport, not the pump's idle latency
    _reply({"name": name, "metadata": agent.metadata().hex(), "base": base, "nbytes": nbytes})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "add_peer":
                _reply({"name": agent.add_peer(bytes.fromhex(cmd["metadata"]))})
            elif op == "remove_peer":
                agent.remove_peer(cmd["name"])
                _reply({})
            elif op == "read":
                batch = ReadBatch.of(cmd["remote_offsets"], cmd["local_offsets"], cmd["sizes"])
                started = time.monotonic()
                agent.read(cmd["peer"], cmd["remote_base"], batch, cmd["timeout_s"])
                _reply({"elapsed_s": time.monotonic() - started})
            elif op == "exit":
                break
            else:
                _reply({"error": "InvalidRequest", "message": f"unknown op {op}"})
        except KVStoreError as exc:
            _reply({"error": type(exc).__name__, "message": str(exc)})
    pump.stop()
    agent.close()
    _reply({})
    os._exit(0)  # dodge the UCX at-exit segfault


if __name__ == "__main__":
    main()
