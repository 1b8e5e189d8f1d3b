"""The [router] section of the one config tree: TOML -> KVSTORE_* -> flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import ConfigError, load_config, to_toml


def test_router_section_from_toml_env_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text(
        "[router]\n"
        'listen = "0.0.0.0:8080"\n'
        'indexer = "10.0.0.9:50061"\n'
        'backends = { "node-a" = "http://10.0.0.1:8000", "node-b" = "unix:/run/vllm.sock" }\n'
    )
    c = load_config(
        f,
        environ={"KVSTORE_ROUTER__LOAD_WEIGHT": "0.25"},
        assignments=["router.backends.node-c=http://10.0.0.3:8000", "router.strategy=approximate"],
    )
    r = c.router
    assert r.listen == "0.0.0.0:8080" and r.indexer == "10.0.0.9:50061"
    assert r.backends == {
        "node-a": "http://10.0.0.1:8000",
        "node-b": "unix:/run/vllm.sock",
        "node-c": "http://10.0.0.3:8000",
    }
    assert r.load_weight == 0.25 and r.strategy == "approximate"
    # --print-config output loads back to the same tree
    again = tmp_path / "again.toml"
    again.write_text(to_toml(c))
    assert load_config(again, environ={}).router == r


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("router.backends.a=10.0.0.1:8000", "router.backends.a"),
        ("router.strategy=precise", "router.strategy"),
        ("router.decision_deadline_s=0", "decision_deadline_s"),
        ("router.lisen=1.2.3.4:5", "lisen"),
        ("router.backends_from_indexer=true", "backends_from_indexer needs router.indexer"),
        ("router.backends_refresh_s=0", "backends_refresh_s"),
        ("router.max_backends=0", "max_backends"),
    ],
)
def test_router_config_errors_name_the_field(assignment: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ={}, assignments=[assignment])


def test_prefill_nodes_may_come_from_the_indexer(tmp_path: Path) -> None:
    """A split over registered backends: its nodes need not be in the static list."""
    f = tmp_path / "pd.toml"
    f.write_text('[router]\nprefill = ["a"]\ndecode = ["b"]\n')
    with pytest.raises(ConfigError, match=r"not in router\.backends"):
        load_config(f, environ={})
    c = load_config(
        f,
        environ={},
        assignments=["router.indexer=127.0.0.1:50061", "router.backends_from_indexer=true"],
    )
    assert c.router.prefill == ["a"] and c.router.backends_from_indexer


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://10.0.0.1:8000", True),
        ("https://e.example:443", True),
        ("unix:/run/vllm.sock", True),
        ("", True),
        ("10.0.0.1:8000", False),
        ("unix:", False),
        ("ftp://x", False),
    ],
)
def test_a_sources_engine_url_is_checked(url: str, ok: bool) -> None:
    from kvstore.indexer.config import parse_source

    text = "node=a,endpoint=tcp://10.0.0.1:5557" + (f",engine_url={url}" if url else "")
    if ok:
        assert parse_source(text).engine_url == url
    else:
        with pytest.raises(ConfigError, match="engine_url"):
            parse_source(text)
