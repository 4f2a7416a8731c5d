"""SGLang's extra config for the pool's HiCache backend (prefill_decode/sglang/config.py), and its page keys: pure
logic, no SGLang import (``kvpool sglang-config`` runs where SGLang is not installed)."""

import json

import pytest

from kvpool.errors import ConfigError
from kvpool.prefill_decode.sglang.config import CLASS, MODULE, StorageConfig, extra_config, server_flags
from kvpool.prefill_decode.sglang.pages import page_key

HASH = "ab" * 32  #: a page hash as SGLang's get_hash_str makes them


def test_the_factorys_keys_default_to_this_backend() -> None:
    config = StorageConfig.from_extra({})
    assert (config.backend_name, config.module_path, config.class_name, config.interface_v1) == (
        "kvpool",
        MODULE,
        CLASS,
        1,
    )


def test_etcd_may_be_one_string_and_sglangs_own_keys_are_left_out() -> None:
    config = StorageConfig.from_extra({"etcd": "h1:2379, h2:2379", "file_storage_path": "/x", "tp_lcm_size": 4})
    assert config.etcd == ("h1:2379", "h2:2379")


def test_an_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"hicache-storage-backend-extra-config.*replica"):
        StorageConfig.from_extra({"replica": 2})


def test_a_bad_value_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match="interface_v1"):
        StorageConfig.from_extra({"interface_v1": 2})


def test_tenant_and_tenants_go_together(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="tenants=PATH"):
        StorageConfig.from_extra({"tenant": "acme"})
    with pytest.raises(ConfigError, match="tenant=NAME"):
        StorageConfig.from_extra({"tenants": "/etc/kvpool/tenants.toml"})


def test_the_flags_carry_the_config_and_only_what_differs() -> None:
    config = StorageConfig(etcd=("10.0.0.1:2379",), cluster="prod", replicas=2)
    flags = server_flags(config)
    assert flags[:4] == [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
    ]
    extra = json.loads(flags[4])
    assert extra == extra_config(config)
    assert set(extra) == {"backend_name", "module_path", "class_name", "interface_v1", "etcd", "cluster", "replicas"}
    assert StorageConfig.from_extra(extra) == config


def test_page_keys_are_rooted_and_deterministic() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    assert page_key(a, HASH) == page_key(a, HASH)
    assert len(page_key(a, HASH)) == 32
    assert page_key(a, HASH) != page_key(b, HASH)
    assert page_key(a, HASH) != page_key(a, "cd" * 32)
