from __future__ import annotations

import pytest

from kvstore.config import GiB, MiB, load_config, parse_bytes, to_toml
from kvstore.errors import ConfigError


def test_defaults_need_no_arguments():
    c = load_config(environ={})
    assert c.server.socket_path == "/tmp/kvstore.sock"
    assert c.dram.capacity_bytes == 1 * GiB
    assert c.node_id  # resolved to the host name
    assert c.dram.path == f"/dev/shm/kvstore-{c.node_id}.dram"


def test_precedence_file_then_env_then_flags(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text(
        'node_id = "from-file"\n[dram]\ncapacity_bytes = "2GiB"\n[leases]\ndefault_ttl_s = 7\n'
    )
    env = {"KVSTORE_DRAM__CAPACITY_BYTES": "3GiB", "KVSTORE_NODE_ID": "from-env"}
    c = load_config(f, environ=env, assignments=["node_id=from-flag"])
    assert c.node_id == "from-flag"
    assert c.dram.capacity_bytes == 3 * GiB  # env beats file
    assert c.leases.default_ttl_s == 7.0  # file beats default


def test_unknown_key_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"capcity_bytes.*\$\.dram"):
        load_config(environ={}, assignments=["dram.capcity_bytes=1"])
    f = tmp_path / "bad.toml"
    f.write_text("[serverr]\nx = 1\n")
    with pytest.raises(ConfigError, match="serverr"):
        load_config(f, environ={})


def test_bad_values_are_precise():
    with pytest.raises(ConfigError, match=r"not a size.*\$\.dram\.capacity_bytes"):
        load_config(environ={}, assignments=["dram.capacity_bytes=lots"])
    with pytest.raises(ConfigError, match="log"):
        load_config(environ={}, assignments=["log.level=loud"])
    with pytest.raises(ConfigError, match="chunk_bytes"):
        load_config(environ={}, assignments=["dram.capacity_bytes=1MiB", "dram.chunk_bytes=64MiB"])
    with pytest.raises(ConfigError, match=r"peer\.secret"):
        load_config(environ={}, assignments=["peer.enabled=true"])
    with pytest.raises(ConfigError, match=r"peer\.pull_piece_bytes must be at least 4096"):
        load_config(environ={}, assignments=["peer.pull_piece_bytes=0"])
    assert (
        load_config(environ={}, assignments=["peer.pull_piece_bytes=256KiB"]).peer.pull_piece_bytes
        == 256 << 10
    )
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(environ={}, assignments=["nonsense"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/k.toml", environ={})


def test_env_strings_become_typed_values():
    c = load_config(
        environ={"KVSTORE_EVENTS__ENABLED": "true", "KVSTORE_LEASES__DEFAULT_TTL_S": "2.5"}
    )
    assert c.events.enabled is True
    assert c.leases.default_ttl_s == 2.5


@pytest.mark.parametrize(
    ("text", "value"),
    [("64MiB", 64 * MiB), ("4G", 4 * GiB), ("100", 100), ("1.5GiB", int(1.5 * GiB)), ("2kb", 2048)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_print_config_round_trips(tmp_path):
    c = load_config(
        environ={},
        assignments=["dram.capacity_bytes=2GiB", "node_id=n1", "peer.peers.node-a=127.0.0.1:1"],
    )
    assert c.peer.peers == {"node-a": "127.0.0.1:1"}
    f = tmp_path / "out.toml"
    f.write_text(to_toml(c))
    assert load_config(f, environ={}) == c


def test_client_and_tool_variables_are_not_config():
    env = {"KVSTORE_ADDRESS": "unix:/x.sock", "KVSTORE_SECRET": "s", "KVSTORE_VLLM_PYTHON": "/p"}
    assert load_config(environ=env).server.socket_path == "/tmp/kvstore.sock"
    with pytest.raises(ConfigError, match=r"capcity_bytes"):
        load_config(environ={"KVSTORE_DRAM__CAPCITY_BYTES": "1"})
    with pytest.raises(ConfigError, match=r"dramm"):
        load_config(environ={"KVSTORE_DRAMM__CAPACITY_BYTES": "1"})
    with pytest.raises(ConfigError, match=r"nodeid"):
        load_config(environ={"KVSTORE_NODEID": "n1"})


def test_every_variable_the_code_reads_leaves_a_daemon_startable():
    """A KVSTORE_* switch a client, tool or test reads (KVSTORE_LOCAL_CHANNEL=0 for a
    bench) is often set in the environment a daemon starts from too: the daemon
    must not take it for a config field (an unknown one would stop it)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    read = re.compile(
        r"(?:environ(?:\.get|\.setdefault)?\s*[\[(]|getenv\(|off_env=)\s*\"(KVSTORE_[A-Z0-9_]+)\""
    )
    names: set[str] = set()
    for package in ("kvstore", "kvstore_connectors", "kvstore_bench", "kvstore_router_client"):
        for path in (root / package).rglob("*.py"):
            names.update(read.findall(path.read_text()))
    assert {"KVSTORE_LOCAL_CHANNEL", "KVSTORE_DIRECT_LOADS", "KVSTORE_SPIN_US"} <= names
    assert {
        "KVSTORE_NATIVE_PROBE",
        "KVSTORE_NATIVE_CHECKSUM",
        "KVSTORE_NATIVE_PRESENCE_WRITE",
    } <= names  # kernels' off switches
    for name in sorted(names - {"KVSTORE_CONFIG"}):  # (that one names the config file)
        load_config(environ={name: "0"})  # raises ConfigError for a config-looking name


def test_events_topic_ids_are_a_comma_list_without_at_signs():
    cfg = load_config(
        environ={"KVSTORE_EVENTS__TOPIC_IDS": "10.0.0.5:8000, 10.0.0.6:8000"}, assignments=[]
    )
    assert cfg.events.topic_id_list() == ["10.0.0.5:8000", "10.0.0.6:8000"]
    assert load_config(environ={}).events.topic_id_list() == []
    with pytest.raises(ConfigError, match="topic_ids may not contain '@'"):
        load_config(environ={}, assignments=["events.topic_ids=pod@x"])
