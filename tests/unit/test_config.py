"""kvpool/core/config.py: every way of making a config checks it, and every failure says where and what to write."""

import dataclasses
import pickle
import re
from typing import Annotated, Any, Literal, Protocol

import msgspec
import pytest
from msgspec import Meta

from kvpool.core.config import Config, Rule, checked, default_of, obey, validated
from kvpool.errors import ConfigError


class Inner(Config, frozen=True):
    high: Annotated[float, Meta(gt=0, le=1, description="a fraction in (0, 1]")] = 0.8
    low: float = 0.5

    def check(self) -> None:
        if not self.low < self.high:
            raise ConfigError(f"low {self.low} must be below high {self.high}")


class Outer(Config, frozen=True):
    inner: Inner = msgspec.field(default_factory=Inner)
    size: Annotated[int, Meta(ge=0, description="an int number of bytes")] = 0
    names: tuple[str, ...] = ()
    spare: Inner | None = None


def test_construction_checks_types_ranges_and_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match=r"Outer: `size` must be an int number of bytes, got str '1GiB'"):
        Outer(size="1GiB")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"`size` must be an int number of bytes, got bool True"):
        Outer(size=True)
    with pytest.raises(ConfigError, match=r"Inner: `high` must be a fraction in \(0, 1\], got float 1.5"):
        Inner(high=1.5)
    with pytest.raises(ConfigError, match=r"low 0\.9 must be below high 0\.8"):
        Inner(low=0.9)
    with pytest.raises(ConfigError, match=r"`inner` expected Inner, got dict \{'high': 0.5\}: write inner=Inner"):
        Outer(inner={"high": 0.5})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="`spare` expected Inner or None, got str 'x'"):
        Outer(spare="x")  # type: ignore[arg-type]
    assert Outer(names=["a"]).names == ("a",)  # type: ignore[arg-type]  # a list given for a tuple: the tuple


class Flags(Config, frozen=True):
    user: str = ""
    password: str = ""

    rules = (Rule("together", "user", "password", "give both or neither"),)


def test_rules_between_fields_or_flags_name_both_and_say_why() -> None:
    assert Flags(user="u", password="p") and Flags()
    with pytest.raises(ConfigError, match=r"^user and password go together: give both or neither$"):
        Flags(user="u")
    rules = (
        Rule("needs", "--replay", "--pub or --sub", "replay what a socket sent"),
        Rule("excludes", "FILE", "--tokens", "the prompt is one of them"),
        Rule("either", "FILE", "--tokens", "a prompt"),
    )
    obey(rules, {"--replay": "x", "--sub": "y", "FILE": "f"})
    obey(rules, {"--tokens": "1 2"})  # a flag not given is not set
    for given, said in (
        ({"--replay": "x", "FILE": "f"}, "--replay is set but --pub or --sub is not: replay what a socket sent"),
        ({"FILE": "f", "--tokens": "1"}, "give FILE or --tokens, not both: the prompt is one of them"),
        ({"--replay": "", "--pub": 0}, "give FILE or --tokens: a prompt"),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
            obey(rules, given)


def test_replace_and_unpickling_check_again() -> None:
    with pytest.raises(ConfigError, match="`size`"):
        msgspec.structs.replace(Outer(), size=-1)
    good = Outer(size=3, spare=Inner(high=0.9))
    assert pickle.loads(pickle.dumps(good)) == good
    make, args = Inner(high=0.9, low=0.1).__reduce__()  # what unpickling calls: the constructor, so the checks
    assert make is Inner and args == (0.9, 0.1)
    with pytest.raises(ConfigError, match="must be below high"):
        make(0.9, 0.95)


def test_validated_names_the_path_and_the_unknown_field() -> None:
    assert validated(Outer, {"inner": {"high": 0.9}, "size": 4}) == Outer(inner=Inner(high=0.9), size=4)
    with pytest.raises(ConfigError, match=r"my settings: `inner.high` must be a fraction in \(0, 1\], got float 2.0"):
        validated(Outer, {"inner": {"high": 2.0}}, "my settings")
    with pytest.raises(ConfigError, match=r"Outer: `inner`: low 0\.9 must be below high 0\.8"):
        validated(Outer, {"inner": {"low": 0.9}})
    with pytest.raises(ConfigError, match="object contains unknown field `sise`; its fields are inner, size, names"):
        validated(Outer, {"sise": 1})
    with pytest.raises(ConfigError, match="`inner` object contains unknown field `hihg`: its fields are high, low"):
        validated(Outer, {"inner": {"hihg": 1}})
    with pytest.raises(ConfigError, match="expected `object`, got `array`"):
        validated(Outer, [1])  # type: ignore[call-overload]


def test_default_of_reads_the_declared_default() -> None:
    assert default_of(Outer, "size") == 0 and default_of(Outer, "inner") == Inner()
    with pytest.raises(LookupError):
        default_of(Outer, "nothing")


class _Scope(Protocol):
    def root(self) -> bytes: ...


@checked
def _sample(
    count: Annotated[int, Meta(ge=1, description="an int >= 1")],
    mode: Literal["fast", "slow"] = "fast",
    key: Annotated[bytes, Meta(min_length=4, max_length=4)] = b"abcd",
    scope: _Scope | None = None,
    extra: Any = None,
) -> tuple[int, str]:
    return count, mode


class _Sampler:
    @checked
    def __init__(self, rate: Annotated[float, Meta(gt=0, le=1, description="a fraction in (0, 1]")]) -> None:
        self.rate = rate


def test_checked_checks_arguments_against_their_annotations() -> None:
    assert _sample(2, mode="slow", scope=object(), extra=object()) == (2, "slow")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"_sample: `count` must be an int >= 1, got int 0 \(expected `int` >= 1\)"):
        _sample(0)
    with pytest.raises(ConfigError, match="`count` must be an int >= 1, got bool True"):
        _sample(True)
    with pytest.raises(ConfigError, match="_sample: `mode` must be one of 'fast', 'slow', got str 'quick'"):
        _sample(1, "quick")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="`key` expected `bytes` of length >= 4, got bytes b'a'"):
        _sample(1, key=b"a")
    with pytest.raises(ConfigError, match=r"_Sampler: `rate` must be a fraction in \(0, 1\], got float 2.0"):
        _Sampler(2.0)
    assert _Sampler(1).rate == 1  # an int for a float: as msgspec takes it, and passed on as given


class _Vault(Config, frozen=True):
    keys: dict[
        Annotated[str, Meta(pattern=r"^[a-z]+\Z", description="lower-case letters")],
        Annotated[bytes, Meta(min_length=4, max_length=4, description="4 bytes", extra={"secret": True})],
    ]


def test_a_secret_is_never_shown_and_a_bad_dict_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"_Vault: `keys\['a'\]` must be 4 bytes \(expected") as caught:
        _Vault(keys={"a": b"hush!"})
    assert "hush" not in str(caught.value)
    with pytest.raises(ConfigError, match="_Vault: `keys` has key 'A'; a key must be lower-case letters"):
        _Vault(keys={"A": b"four"})


@checked
@dataclasses.dataclass(frozen=True)
class _Grouped:
    group: Annotated[int, Meta(ge=2, multiple_of=2, description="an even int >= 2")] = 2
    kind: Literal["a", "b"] = "a"


def test_checked_on_a_dataclass_checks_its_fields_at_construction() -> None:
    assert _Grouped(4, "b") == _Grouped(group=4, kind="b")
    with pytest.raises(ConfigError, match=r"_Grouped: `group` must be an even int >= 2, got int 3"):
        _Grouped(3)
    with pytest.raises(ConfigError, match="_Grouped: `kind` must be one of 'a', 'b', got str 'c'"):
        _Grouped(kind="c")  # type: ignore[arg-type]


@checked
def _takes_inner(inner: Inner, spare: Inner | None = None) -> float:
    return inner.high


def test_checked_refuses_a_dict_for_a_config() -> None:
    assert _takes_inner(Inner(high=0.9)) == 0.9
    with pytest.raises(
        ConfigError, match=r"_takes_inner: `inner` expected Inner, got dict .*: write inner=Inner\(...\)"
    ):
        _takes_inner({"high": 0.9})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="`spare` expected Inner or None"):
        _takes_inner(Inner(), {"high": 0.9})  # type: ignore[arg-type]
