"""Tenants: keys rooted in each tenant's secret (two tenants' keys never meet; a shared namespace only for those who
list it), the tenants file's checks, API keys.  Pure logic: no pool."""

from pathlib import Path

import pytest

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.errors import ConfigError, SetupError, TenantRefused
from kvpool.pool.tenants import Tenants, new_secret

IDENTITY = CacheIdentity(model="m", kv_dtype="float16", layout="l", chunk_size=4)
TOKENS = list(range(16))
FILE = f"""
[tenants.acme]
secret = "{new_secret()}"
api_keys = ["sk-acme"]
dram_mib = 64
shared = ["public"]

[tenants.globex]
secret = "{new_secret()}"
api_keys = ["sk-globex-1", "sk-globex-2"]
shared = ["public"]

[tenants.initech]
secret = "{new_secret()}"

[shared.public]
secret = "{new_secret()}"
"""


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    return Tenants.load(str(path))


def test_two_tenants_keys_never_meet_and_a_shared_namespace_is_shared(tenants: Tenants) -> None:
    plain = chunk_keys(IDENTITY, TOKENS)
    acme = chunk_keys(IDENTITY, TOKENS, tenants.scope("acme"))
    globex = chunk_keys(IDENTITY, TOKENS, tenants.scope("globex"))
    assert len(acme) == len(globex) == len(plain) == 4
    assert not set(acme) & set(globex) and not set(acme) & set(plain) and not set(globex) & set(plain)
    assert chunk_keys(IDENTITY, TOKENS, tenants.scope("acme")) == acme  # deterministic: a tenant hits its own
    assert chunk_keys(IDENTITY, TOKENS[:8], tenants.scope("acme")) == acme[:2]  # still a prefix chain
    shared_a = chunk_keys(IDENTITY, TOKENS, tenants.scope("acme", "public"))
    assert shared_a == chunk_keys(IDENTITY, TOKENS, tenants.scope("globex", "public"))
    assert not set(shared_a) & (set(acme) | set(globex) | set(plain))
    assert tenants.scope("globex", "public").tenant == "globex"  # charged to whoever puts


def test_a_scope_that_is_not_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="chunk_keys: `scope` must be a Scope"):
        chunk_keys(IDENTITY, TOKENS, "acme")  # type: ignore[arg-type]


def test_what_a_request_may_not_name_is_refused(tenants: Tenants) -> None:
    with pytest.raises(TenantRefused, match=r"may not use shared namespace 'public'.*tenants.initech"):
        tenants.scope("initech", "public")
    with pytest.raises(TenantRefused, match="unknown tenant 'nobody'"):
        tenants.scope("nobody")
    with pytest.raises(TenantRefused, match="may not use shared namespace 'other'"):
        tenants.scope("acme", "other")
    assert tenants.by_api_key("sk-globex-2") == "globex" and tenants.knows("sk-acme")
    with pytest.raises(TenantRefused, match="Authorization: Bearer"):
        tenants.by_api_key("sk-wrong")
    assert not tenants.knows("")


def test_secrets_stay_out_of_reprs(tenants: Tenants) -> None:
    secret = tenants.tenants["acme"].secret.hex()
    for shown in (repr(tenants), repr(tenants.tenants["acme"]), repr(tenants.scope("acme", "public")), str(tenants)):
        assert secret not in shown and "sk-acme" not in shown
    assert tenants.quotas() == {"acme": (64 << 20, 0)}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a]\nsecret = 'abcd'\n", "at least 16 bytes of hex"),
        ("[tenants.a]\nsecret = 'zz'\n", "at least 16 bytes of hex"),
        ("[tenants.a]\nsecret_env = 'KVPOOL_NO_SUCH_VAR'\n", "not set in the environment"),
        (f"[tenants.a]\nsecret = '{'ab' * 16}'\nshared = ['pub']\n", "no \\[shared.\\*\\]"),
        (
            f"[tenants.a]\nsecret = '{'ab' * 16}'\ndram_mib = -1\n",
            r"tenants\['a'\].dram_mib` must be an int >= 0 \(MiB per node; 0: no quota\), got int -1",
        ),
        (f"[tenants.a]\nsecret = '{'ab' * 16}'\nquota = 1\n", "unknown field `quota`"),
        (
            f"[tenants.a]\nsecret = '{'ab' * 16}'\napi_keys = 'k'\n",
            "api_keys` must be a list of non-empty strings",
        ),
        (
            f"[tenants.a]\nsecret = '{'ab' * 16}'\napi_keys = ['k']\n[tenants.b]\nsecret = '{'cd' * 16}'\napi_keys = ['k']\n",
            "share an API key",
        ),
        ("[tenant.a]\n", "unknown field `tenant`"),
        ("", "no \\[tenants.<name>\\] table"),
        ("[tenants\n", "is not TOML"),
        (f"[tenants.'a b']\nsecret = '{'ab' * 16}'\n", "names are 1-63"),
    ],
)
def test_a_malformed_tenants_file_says_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(SetupError if "not set in the environment" in says else ConfigError, match=says):
        Tenants.load(str(path))


def test_a_missing_file_and_a_secret_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SetupError, match="cannot be read"):
        Tenants.load(str(tmp_path / "absent.toml"))
    monkeypatch.setenv("KVPOOL_TEST_SECRET", new_secret())
    path = tmp_path / "t.toml"
    path.write_text("[tenants.a]\nsecret_env = 'KVPOOL_TEST_SECRET'\n")
    assert Tenants.load(str(path)).scope("a").tenant == "a"
