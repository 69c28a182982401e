"""Options declared as data, and the one reader that coerces and bounds them.

An option family is a frozen dataclass deriving from ``Options``, each field declared with
``option(default, kind, ...)``: its type, default, bounds and validator. The setting's name
is the family's ``PREFIX`` and the field's name in capitals, unless the field names its own.
``from_sources`` reads each field from the first source that sets it (``Sources``: the one
order, docs/design.md, "Settings") and hands the value to ``coerce``, which turns text or a
Celery config value into the field's type, checks its bounds, applies its validator, and
raises a ``ConfigError`` naming the setting. The families themselves: ``outbox.core.config``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from .errors import ConfigError
from .redact import register_secret

#: What a setting's value is read as: text, a whole number, a number, a boolean
#: (1/true/yes/on, 0/false/no/off), a comma-separated list of names, or a TCP port (0: off).
KINDS = ("str", "int", "float", "bool", "names", "port")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    """How one setting is read (Celery's ``celery.app.defaults.Option`` in spirit)."""

    kind: str
    #: Bounds of a number: at least ``minimum``, above ``above`` (exclusive), at most ``maximum``.
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    #: ``check(value, setting) -> value``: the validator of a text value (``outbox.core.checks``).
    check: Callable[[Any, str], Any] | None = None
    #: The setting's name, when it is not the family's PREFIX + FIELD.
    name: str | None = None
    #: When set, a value set but empty is this error instead of meaning "unset".
    empty_error: str | None = None
    #: The name the value goes by elsewhere (the database broker's kombu transport option).
    key: str | None = None
    #: A secret (a key's passphrase): masked wherever it shows up once read (``outbox.core.redact``),
    #: and left out of the family's repr.
    secret: bool = False

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


def option(default: Any, kind: str, **how: Any) -> Any:
    """A field of an option family: its default and how its setting is read (``Option``)."""
    return field(default=default, repr=not how.get("secret", False), metadata={"option": Option(kind, **how)})


class Sources:
    """Where settings come from, in order: the first layer that sets a name (to anything but
    None or an empty string) gives its value. Layers are mappings (a Celery config's OUTBOX_*
    keys, ``os.environ``, Django settings) or other ``Sources``."""

    def __init__(self, *layers: Mapping[str, Any] | Sources | None) -> None:
        self.layers: list[Mapping[str, Any]] = []
        for layer in layers:
            if isinstance(layer, Sources):
                self.layers.extend(layer.layers)
            elif layer is not None:
                self.layers.append(layer)

    def get(self, name: str) -> Any:
        return next((layer[name] for layer in self.layers if layer.get(name) not in (None, "")), None)

    def set_but_empty(self, name: str) -> bool:
        """Whether the first layer that sets ``name`` (to anything but None) sets it blank. Only
        that layer decides: an empty value further down (settings.py's
        ``os.environ.get("X", "")``) once refused a valid one above it (found in review)."""
        value = next((layer[name] for layer in self.layers if layer.get(name) is not None), None)
        return isinstance(value, str) and not value.strip()


OptionsT = TypeVar("OptionsT", bound="Options")


class Options:
    """The base of an option family: a frozen dataclass whose fields are declared with ``option``."""

    #: What every setting of the family starts with.
    PREFIX: ClassVar[str] = "OUTBOX_"
    #: Whether errors quote the value as given (``'nan'``) or as read (``nan``, ``-2.0``).
    SHOW_GIVEN: ClassVar[bool] = True

    @classmethod
    def declared(cls) -> dict[str, tuple[Field[Any], Option]]:
        """Setting name -> (field, how it is read), in declaration order."""
        found = {}
        for f in fields(cls):  # type: ignore[arg-type]
            how = f.metadata.get("option")
            if how is not None:
                found[how.name or cls.PREFIX + f.name.upper()] = (f, how)
        return found

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.declared())

    @classmethod
    def from_sources(cls: type[OptionsT], *sources: Mapping[str, Any] | Sources | None) -> OptionsT:
        """Every field from the first source that sets its setting, else its default."""
        found = Sources(*sources)
        values: dict[str, Any] = {}
        for name, (f, how) in cls.declared().items():
            if how.empty_error and found.set_but_empty(name):
                raise ConfigError(f"{name} is set but empty: {how.empty_error}")
            raw = found.get(name)
            if raw is not None:
                value = coerce(how, name, raw, show_given=cls.SHOW_GIVEN)
                if how.secret and value is not None:
                    register_secret(str(value))
                if value is not None:
                    values[f.name] = value
        return cls(**values)

    @classmethod
    def default_of(cls, name: str) -> Any:
        f = cls.declared()[name][0]
        return None if f.default is MISSING else f.default


def coerce(how: Option, name: str, raw: Any, *, show_given: bool = True) -> Any:
    """The one reader: ``raw`` (text from the environment, or a Celery config or Django value)
    as the setting's type, within its bounds, through its validator. None: unset."""
    if how.kind == "str":
        text = str(raw).strip()
        return (how.check(text, name) if how.check else text) if text else None
    if how.kind == "bool":
        return _boolean(name, raw)
    if how.kind == "names":
        return _names(name, raw)
    if how.kind == "port":
        return _port(name, raw)
    return _number(how, name, raw, show_given)


def _number(how: Option, name: str, raw: Any, show_given: bool) -> float | int:
    kind = int if how.kind == "int" else float
    if isinstance(raw, bool):
        raise ConfigError(f"{name}={raw!r} is not a number")
    try:
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError  # int() cut 2.5 (a Django setting, a Celery config key) to 2 unsaid
        value = kind(str(raw).strip()) if isinstance(raw, str) else kind(raw)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    shown = repr(raw) if show_given else repr(value)
    if not math.isfinite(value):  # NaN compares false with everything: checked first
        raise ConfigError(f"{name}={shown} must be a finite number")
    if how.minimum is not None and value < how.minimum:
        raise ConfigError(f"{name}={shown} must be >= {_plain(how.minimum)}")
    if how.above is not None and value <= how.above:
        raise ConfigError(f"{name}={shown} must be > {_plain(how.above)}")
    if how.maximum is not None and value > how.maximum:
        raise ConfigError(f"{name}={shown} is above the maximum of {_plain(how.maximum)}")
    return value


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _boolean(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def _port(name: str, raw: Any) -> int | None:
    if raw in (0, "0"):
        return None  # off
    try:
        port = int(str(raw).strip())
    except ValueError:
        port = -1
    if isinstance(raw, bool) or not 0 < port < 65536:
        raise ConfigError(f"{name}={raw!r} is not a port number")
    return port


def _names(name: str, raw: Any) -> tuple[str, ...]:
    """A comma-separated list (or, from a Celery config key, a list or tuple) of names: no
    empty item, no whitespace inside one, each at most 255 bytes (an AMQP short string,
    which is what a topic travels as)."""
    if isinstance(raw, str):
        items = raw.split(",")
    elif isinstance(raw, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in raw):
        items = list(raw)
    else:
        raise ConfigError(f"{name}={raw!r} is not a comma-separated list of names")
    found: list[str] = []
    for item in items:
        item = item.strip()
        if not item or any(c.isspace() for c in item) or len(item.encode("utf-8", "surrogatepass")) > 255:
            raise ConfigError(f"{name}={raw!r}: {item!r} is not a name (comma-separated, no empty item, "
                              "no whitespace, at most 255 bytes each)")
        if item not in found:
            found.append(item)
    return tuple(found)


__all__ = ["Option", "option", "Options", "Sources", "coerce", "KINDS"]
