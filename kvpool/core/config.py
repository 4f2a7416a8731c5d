"""Configs as strict msgspec Structs: types and ranges declared once, checked by one function.

A config class derives from :class:`Config` and declares each field's type and range in its annotation
(``Annotated[int, Meta(ge=0, description="...")]``; the ``description`` is what the error tells the user to write),
rules between two fields in its ``rules`` (:class:`Rule`), the others (a path that must exist) in :meth:`Config.check`.

Every way of making a config checks it: keyword construction (``PoolConfig(dram_bytes=...)``), ``msgspec.structs
.replace``, unpickling (a config sent to a Ray actor is checked again where it lands, so the actor re-checks
nothing by hand), and :func:`validated` for a mapping from outside (a TOML table, vLLM's extra config).  A public
function's arguments are declared the same way, in its annotations, and :func:`checked` checks them.  Every
failure is a :class:`~kvpool.errors.ConfigError` naming the config, the field path and what to write::

    PoolConfig: `watermarks.high` must be a fraction of DRAM capacity in (0, 1], got float 1.5 (expected `float` <= 1.0)

Checking is strict: ``bool`` is not an ``int``, ``"16GiB"`` is not an ``int``, a dict is not a nested config, and
unknown fields are refused.  A field declared ``Meta(extra={"secret": True})`` (a key) is never shown in an error.
"""

import contextvars
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Meta

from kvpool.errors import ConfigError

__all__ = [
    "Config",
    "Finite",
    "Fraction",
    "NonNegative",
    "Positive",
    "PowerOfTwo",
    "Rule",
    "Seconds",
    "checked",
    "default_of",
    "obey",
    "one_of",
    "validated",
]

C = TypeVar("C", bound="Config")
P = ParamSpec("P")
R = TypeVar("R")

_FLOAT_MAX = 1.7976931348623157e308
#: a finite float (NaN fails both bounds)
Finite = typing.Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
NonNegative = typing.Annotated[int, Meta(ge=0)]
Positive = typing.Annotated[int, Meta(ge=1)]
#: a fraction in (0, 1]: a sampling rate, a share
Fraction = typing.Annotated[float, Meta(gt=0, le=1, description="a number in (0, 1]")]
#: a finite number of seconds > 0
Seconds = typing.Annotated[float, Meta(gt=0, le=_FLOAT_MAX, description="a number of seconds > 0")]
if typing.TYPE_CHECKING:
    PowerOfTwo = int
else:  #: an alignment in bytes: a power of two, 1 to 2**40 (msgspec has no such bound, so the powers are listed)
    PowerOfTwo = typing.Annotated[
        typing.Literal[tuple(1 << i for i in range(41))],
        Meta(description="a power of two, e.g. 4096 (bytes, at most 2**40)"),
    ]

# What __post_init__ does: a config made in code round-trips through msgspec.convert (_CHECK); the copy that
# round trip makes checks nothing (_COPY); one converted by validated() is checked by msgspec already (_CONVERT).
_CHECK, _COPY, _CONVERT = "check", "copy", "convert"
_mode: contextvars.ContextVar[str] = contextvars.ContextVar("kvpool_config_mode", default=_CHECK)
_SEGMENT = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+|\.\.\.)\]")
_AT = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")


class Rule(typing.NamedTuple):
    """A rule between fields that a config declares in its ``rules`` (a command, between its flags: :func:`obey`):
    ``"together"``, ``a`` and ``b`` set both or neither; ``"needs"``, a set ``a`` needs ``b``; ``"excludes"``, not both;
    ``"either"``, at least one.  "Set" is truthy; ``b`` may be ``"x or y"``.  ``why`` ends the error: what to write."""

    kind: typing.Literal["together", "needs", "excludes", "either"]
    a: str
    b: str
    why: str

    def broken(self, given: object) -> str:
        """The error's sentence if ``given`` (a config, or a mapping of names to values) breaks the rule, or ``""``."""
        value = given.get if isinstance(given, Mapping) else functools.partial(getattr, given)
        a, b = (any(value(name) for name in names.split(" or ")) for names in (self.a, self.b))
        ok, said = _RULES[self.kind]
        return "" if ok(a, b) else f"{said.format(a=self.a, b=self.b)}: {self.why}"


_RULES: dict[str, tuple[Callable[[bool, bool], bool], str]] = {
    "together": (lambda a, b: a == b, "{a} and {b} go together"),
    "needs": (lambda a, b: b or not a, "{a} is set but {b} is not"),
    "excludes": (lambda a, b: not (a and b), "give {a} or {b}, not both"),
    "either": (lambda a, b: a or b, "give {a} or {b}"),
}


def obey(rules: Iterable[Rule], given: object) -> None:
    """``ConfigError`` with the sentence of the first of ``rules`` that ``given`` (a config, or a command's flags as
    a mapping of their names to their values: ``{"--zmq": ..., "--zmq-replay": ...}``) breaks."""
    if broken := next(filter(None, (rule.broken(given) for rule in rules)), ""):
        raise ConfigError(broken)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of kvpool's configs: frozen, unknown fields refused, every field's type and range checked on every
    construction (see the module docstring).  Subclasses declare rules between two fields in ``rules`` and
    override :meth:`check` for the others."""

    #: rules between fields, checked after the fields' types and ranges and before :meth:`check`
    rules: typing.ClassVar[tuple[Rule, ...]] = ()

    def __post_init__(self) -> None:
        mode = _mode.get()
        if mode == _COPY:
            return
        if mode == _CHECK:
            _round_trip(self)
        obey(self.rules, self)
        self.check()

    def check(self) -> None:
        """Rules across fields or outside the process (a file that must exist); ``ConfigError`` saying what to
        write.  The fields' own types and ranges are checked before this runs."""


@typing.overload
def validated(cls: type[C], value: Mapping[str, Any] | C, where: str = "", *, strict: bool = True) -> C: ...
@typing.overload
def validated(cls: Any, value: Any, where: str, *, strict: bool = True) -> Any: ...
def validated(cls: Any, value: Any, where: str = "", *, strict: bool = True) -> Any:
    """``value`` (a mapping of field names, nested configs as mappings, or a ``cls`` already) as a checked
    ``cls``; ``ConfigError`` naming ``where`` (default: the class name), the field path and what to write.
    ``cls`` may also be any type msgspec checks (``list[ChunkKey]``), then ``where`` names the value.
    ``strict=False`` for text from a command line or the environment: numbers and booleans written as strings
    (``"0.5"``, ``"true"``) are read as such."""
    struct = isinstance(cls, type) and issubclass(cls, msgspec.Struct)
    if struct and isinstance(value, cls):
        return value
    token = _mode.set(_CONVERT)
    try:
        return msgspec.convert(value, cls, strict=strict)
    except msgspec.ValidationError as exc:
        raise _config_error(cls, exc, value, where or cls.__name__) from None
    finally:
        _mode.reset(token)


def one_of(choices: Iterable[str], value: Any, where: str) -> str:
    """``value`` if it is one of the names ``choices`` (a model, a tier, a flag's values); ``ConfigError`` naming
    ``where`` and the choices otherwise (a ``Literal`` of them, checked by msgspec as any declared type)."""
    return validated(_names(tuple(choices)), value, where)


@functools.lru_cache(maxsize=64)
def _names(names: tuple[str, ...]) -> Any:
    *others, last = names
    rule = f"{', '.join(others)} or {last}" if len(others) < 2 else f"one of {', '.join(others)} or {last}"
    return typing.Annotated[typing.Literal[names], Meta(description=rule if others else repr(last))]


T = TypeVar("T")


@typing.overload
def checked(fn: type[T]) -> type[T]: ...
@typing.overload
def checked(fn: Callable[P, R]) -> Callable[P, R]: ...
def checked(fn: Any) -> Any:
    """``fn`` (a function, or a dataclass: its ``__init__``) with its arguments checked against its annotations on
    every call, as :func:`validated` checks a config: strictly (``bool`` is no ``int``, a dict is no config), with
    the ranges, lengths and patterns an ``Annotated[..., Meta(...)]`` declares, and a ``ConfigError`` naming the
    function, the parameter and (from the ``Meta``'s ``description``) what to pass.  ``fn`` gets its arguments as
    given.  A parameter annotated ``Any`` or with a ``Protocol`` that is
    not ``runtime_checkable`` (one that is: an ``isinstance``), and an unannotated ``self``, are not checked.  About
    a microsecond a call: not for per-chunk paths."""
    if isinstance(fn, type):
        fn.__init__ = checked(fn.__init__)  # type: ignore[misc]
        return fn
    hints = {name: _resolved(fn, hint) for name, hint in fn.__annotations__.items()}
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"@checked {fn.__qualname__}: *args and **kwargs cannot be checked")
    fields = [(p.name, _checkable(hints.get(p.name, Any))) for p in params]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    where = fn.__qualname__.removesuffix(".__init__")
    arguments = msgspec.defstruct(
        f"{where}(arguments)",
        [(name, kind, defaults[name]) if name in defaults else (name, kind) for name, kind in fields],
        forbid_unknown_fields=True,
    )
    names = [name for name, _ in fields]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        given = dict(zip(names, args, strict=False))  # too many: the call below says so
        given.update(kwargs)
        _no_mappings(arguments, given, where)
        try:
            msgspec.convert(given, arguments, strict=True)
        except msgspec.ValidationError as exc:
            raise _config_error(arguments, exc, given, where) from None
        return fn(*args, **kwargs)

    return call


def _resolved(fn: Callable[..., Any], hint: Any) -> Any:
    """An annotation (a string under ``from __future__ import annotations``) as a type; ``Any`` for a name
    imported for type checkers only."""
    try:
        return eval(hint, fn.__globals__) if isinstance(hint, str) else hint
    except NameError:
        return Any


def _checkable(hint: Any) -> Any:
    """``hint``, or ``Any`` where msgspec cannot check it: a Protocol that is not ``runtime_checkable`` (or a union
    with one: ``isinstance`` refuses), a union msgspec does not take."""
    kind, _ = _unwrap(hint)
    kinds = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    protocols = [k for k in kinds if isinstance(k, type) and getattr(k, "_is_protocol", False)]
    if any(not getattr(k, "_is_runtime_protocol", False) for k in protocols):
        return Any
    try:
        msgspec.inspect.type_info(hint)
    except TypeError:  # a type msgspec does not check (``str | os.PathLike[str]``)
        return Any
    return hint


def default_of(cls: type[msgspec.Struct], name: str) -> Any:
    """The default of field ``name`` of ``cls`` (its factory's value, for a factory field), so that a default is
    written once: where the field is declared."""
    for f in msgspec.structs.fields(cls):
        if f.name == name and f.default is not msgspec.NODEFAULT:
            return f.default
        if f.name == name and f.default_factory is not msgspec.NODEFAULT:
            return f.default_factory()
    raise LookupError(f"{cls.__name__} has no field {name!r} with a default")


def _round_trip(config: "Config") -> None:
    """Check a config made in code as :func:`validated` checks a mapping, and keep msgspec's normalised values
    (a list given for a tuple field becomes a tuple, an int for a float field a float)."""
    cls = type(config)
    raw = msgspec.structs.asdict(config)
    _no_mappings(cls, raw, cls.__name__)
    token = _mode.set(_COPY)
    try:
        copy = msgspec.convert(raw, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise _config_error(cls, exc, raw, cls.__name__) from None
    finally:
        _mode.reset(token)
    for name, value in raw.items():
        normal = getattr(copy, name)
        if normal is not value:
            msgspec.structs.force_setattr(config, name, normal)


def _no_mappings(cls: type, raw: Mapping[str, Any], where: str) -> None:
    """A field declared as a config holds one: msgspec would convert a dict given in code, which code must not
    pass (and a function would get the dict, not the config)."""
    for name, kinds in _nested(cls).items():
        if name in raw and not isinstance(raw[name], kinds):
            names = " or ".join("None" if k is types.NoneType else k.__name__ for k in kinds)
            raise ConfigError(
                f"{where}: `{name}` expected {names}, got {_shown(raw[name])}: write {name}={kinds[0].__name__}(...)"
            )


_NESTED: dict[type, dict[str, tuple[type, ...]]] = {}
_MISSING = object()


def _nested(cls: type) -> dict[str, tuple[type, ...]]:
    """The fields of ``cls`` declared as a Struct (or a Struct or None), and the types they take: a dict there
    would be converted, and code must pass the config itself."""
    if cls not in _NESTED:
        hints = typing.get_type_hints(cls)
        _NESTED[cls] = {}
        for f in msgspec.structs.fields(cls):
            kinds = typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],)
            if any(isinstance(k, type) and issubclass(k, msgspec.Struct) for k in kinds):
                _NESTED[cls][f.name] = kinds
    return _NESTED[cls]


def _config_error(cls: Any, exc: msgspec.ValidationError, raw: Any, where: str) -> ConfigError:
    """``exc`` as a sentence: where, the field path, what msgspec expected, the value given, what to write."""
    text = str(exc)
    m = _AT.search(text)
    struct = isinstance(cls, type) and issubclass(cls, msgspec.Struct)
    if m is None and isinstance(exc.__cause__, ConfigError):  # the config's own check(): its sentence
        return type(exc.__cause__)(f"{where}: {exc.__cause__}")
    if m is None and struct:  # the top level: an unknown field, or not a mapping at all
        known = ", ".join(f.name for f in msgspec.structs.fields(cls))
        return ConfigError(f"{where}: {_lower(text)}; its fields are {known}")
    path, said = (m["path"], text[: m.start()]) if m else ("", text)
    if not said.startswith(("Expected", "Object", "Invalid")):  # a check() of a nested config: its own sentence
        return ConfigError(f"{where}: `{path.lstrip('.')}`: {said}")
    shown, found, value, hint, kind = _walk(cls, raw, path)
    at = f"{where}: `{shown}`" if struct else f"{where}{shown}"  # a value (not a config) is named by where
    if m and m["key"] and isinstance(value, Mapping):  # a dict's key: name it and what a key must be
        key_kind, meta = _unwrap(typing.get_args(kind)[0])
        bad = next((k for k in value if not _fits(k, typing.get_args(kind)[0])), None)
        rule = _description(meta)
        if not rule:  # the field's own description says more
            choices = ", ".join(map(repr, typing.get_args(key_kind)))
            rule = f"one of {choices}" if typing.get_origin(key_kind) is typing.Literal else f"a {key_kind.__name__}"
            rule += f" ({hint})" if hint else ""
        return ConfigError(f"{at} has key {bad!r:.60}; a key must be {rule}")
    expected = re.sub(r" matching regex '.*'$", "", _lower(said.split(", got ")[0]))
    if said.startswith("Expected `object`") and isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        expected = f"expected a {kind.__name__}"
    if said.startswith("Object contains unknown field") and isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        hint = "its fields are " + ", ".join(f.name for f in msgspec.structs.fields(kind))
        return ConfigError(f"{at} {expected}: {hint}")
    if typing.get_origin(kind) is typing.Literal:  # msgspec says "invalid enum value": say the choices
        choices = ", ".join(repr(c) for c in typing.get_args(kind))
        return ConfigError(f"{at} must be {hint or 'one of ' + choices}, got {_shown(value)}")
    got = f", got {_shown(value)}" if found and not said.startswith(("Invalid", "Object")) else ""
    if hint:  # a pattern is said by the description alone
        said_more = "" if " matching regex " in said else f" ({expected})"
        return ConfigError(f"{at} must be {hint}{got}{said_more}")
    return ConfigError(f"{at} {expected}{got}")


def _walk(cls: Any, raw: Any, path: str) -> tuple[str, bool, Any, str, Any]:
    """``(the path shown, found, the value at path in raw, the description declared for it, its type)``.  A dict's
    key is ``[...]`` in msgspec's paths: the first key whose value fails is looked for and shown instead."""
    kind, meta = _unwrap(cls)
    shown, found, value, hint = "", True, raw, _description(meta)
    for m in _SEGMENT.finditer(path):
        name, index = m[1], m[2]
        if name is not None:
            try:
                kind, meta = _unwrap(typing.get_type_hints(kind, include_extras=True).get(name))
            except TypeError:
                kind, meta = None, []
            hint = _description(meta)
            value = value.get(name, _MISSING) if isinstance(value, Mapping) else getattr(value, name, _MISSING)
            found, shown = found and value is not _MISSING and not _secret(meta), f"{shown}.{name}" if shown else name
            continue
        args = typing.get_args(kind)
        if typing.get_origin(kind) is tuple and ... not in args:  # a fixed-size tuple: its own type per place
            inner = args[int(index)] if index.isdigit() and int(index) < len(args) else Any
        else:  # list[X], tuple[X, ...], dict[K, X]
            inner = args[0] if args[-1:] == (...,) else args[-1] if args else Any
        kind, meta = _unwrap(inner)
        hint = _description(meta) or hint
        if index == "..." and found and isinstance(value, Mapping):
            key = next((k for k, v in value.items() if not _fits(v, inner)), _MISSING)
            found = key is not _MISSING
            value, shown = (value[key], f"{shown}[{key!r}]") if found else (None, f"{shown}[...]")
        else:
            found = found and index != "..." and isinstance(value, (list, tuple)) and int(index) < len(value)
            value, shown = value[int(index)] if found else None, f"{shown}[{index}]"
        found = found and not _secret(meta)
    return shown, found, value, hint, kind


def _description(meta: list[Any]) -> str:
    """The ``description`` declared in an ``Annotated`` type's ``Meta``, or ``""``."""
    return next((x.description for x in meta if isinstance(x, Meta) and x.description), "")


def _secret(meta: list[Any]) -> bool:
    """Whether a field is declared secret (``Meta(extra={"secret": True})``): its value is never shown."""
    return any(isinstance(x, Meta) and (x.extra or {}).get("secret") for x in meta)


def _fits(value: Any, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind, strict=True)
    except (msgspec.ValidationError, ConfigError):
        return False
    return True


def _unwrap(kind: Any) -> tuple[Any, list[Any]]:
    if typing.get_origin(kind) is typing.Annotated:
        return kind.__origin__, list(kind.__metadata__)
    return kind, []


def _shown(value: Any) -> str:
    return "None" if value is None else f"{type(value).__name__} {value!r:.60}"


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]
