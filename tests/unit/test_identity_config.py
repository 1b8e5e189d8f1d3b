"""Principals in the config tree and their credentials (kvstore/identity.py)."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.identity import CLUSTER, Authorizer, PrincipalConfig, client_token, hash_token


def test_principals_from_flags_and_env_with_comma_lists():
    cfg = load_config(
        environ={"KVSTORE_AUTH__PRINCIPALS__ALICE__TENANTS": "a, b"},
        assignments=[
            f"auth.principals.alice.token_sha256={hash_token('t-alice')}",
            "auth.principals.alice.uids=1001,1002",
            "auth.principals.ops.cert_names=ops-1",
            "auth.principals.ops.roles=admin",
        ],
    )
    alice = cfg.auth.principals["alice"]
    assert alice.tenants == ["a", "b"] and alice.uids == [1001, 1002]
    auth = Authorizer(cfg.auth.principals, "auth.principals")
    p = auth.from_token("t-alice")
    assert p is not None and p.name == "alice" and p.may_use("ns-1", "a", "m")
    assert not p.may_use("ns-1", "c", "m") and not p.has_role("admin")
    assert auth.from_token("t-bob") is None and auth.from_token("") is None
    assert auth.from_peer(1002, None) is p and auth.from_peer(7, 7) is None
    ops = auth.from_cert_names([b"ops-1"])
    assert ops is not None and ops.has_role("node") and not ops.may_use("n", "a", "m")


def test_default_is_no_authorizer():
    assert Authorizer.from_config(load_config(environ={}).auth.principals, "x") is None


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"token_sha256": "abc", "tenants": ["a"]}, "not 64 hex digits"),
        ({"tenants": ["a"]}, "no credential"),
        ({"uids": [1]}, "neither tenants nor roles"),
    ],
)
def test_bad_principals_are_refused_naming_the_field(fields, error):
    with pytest.raises(ConfigError, match=error):
        Authorizer({"p": PrincipalConfig(**fields)}, "auth.principals")


def test_one_credential_maps_to_one_principal():
    digest = hash_token("same")
    with pytest.raises(ConfigError, match="another principal has this token"):
        Authorizer(
            {
                "a": PrincipalConfig(token_sha256=digest, tenants=["a"]),
                "b": PrincipalConfig(token_sha256=digest, tenants=["b"]),
            },
            "auth.principals",
        )
    with pytest.raises(ConfigError, match="1001 is also a's"):
        Authorizer(
            {
                "a": PrincipalConfig(uids=[1001], tenants=["a"]),
                "b": PrincipalConfig(uids=[1001], tenants=["b"]),
            },
            "auth.principals",
        )
    with pytest.raises(ConfigError, match="reserved"):
        Authorizer({CLUSTER.name: PrincipalConfig(uids=[1], tenants=["a"])}, "auth.principals")


def test_unknown_principal_field_is_a_config_error():
    with pytest.raises(ConfigError, match="tenant"):
        load_config(environ={}, assignments=["auth.principals.a.tenant=x"])


def test_client_token_order(tmp_path):
    f = tmp_path / "t"
    f.write_text("from-file\n")
    f.chmod(0o600)
    env = {"KVSTORE_TOKEN": "from-env", "KVSTORE_TOKEN_FILE": str(f)}
    assert client_token("given", "", env) == "given"
    assert client_token(None, str(f), env) == "from-file"
    assert client_token(None, "", env) == "from-env"
    assert client_token(None, "", {"KVSTORE_TOKEN_FILE": str(f)}) == "from-file"
    assert client_token(None, "", {}) == ""
