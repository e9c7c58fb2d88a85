"""CLI flags generated from config fields: each field's metadata holds its flag, help and group."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

FLAG_KEY = "mmserve_flag"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one config field appears on the command line (its name is the field's, dashed)."""

    help: str
    group: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    nargs: str | None = None
    metavar: str | None = None
    action: str | type[argparse.Action] | None = None
    aliases: tuple[str, ...] = ()
    required: bool = False
    topic: str = ""  # a subset another command shares (encode takes the media "url"/"decode")
    unit: str = ""  # "bytes": the help shows the default as KiB/MiB/GiB; "count": Ki/Mi/Gi


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - argparse's own name
    group: str,
    default_factory: Callable[[], Any] | None = None,
    repr: bool = True,  # noqa: A002 - dataclasses' own name
    **spec: Any,
) -> Any:
    """A dataclass field with a CLI flag. `{default}` in `help` shows the field's default."""
    metadata = {FLAG_KEY: FlagSpec(help=help, group=group, **spec)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, repr=repr, metadata=metadata)
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, FlagSpec]]:
    """The fields of a config class that are CLI flags, in declaration order."""
    return [(f, f.metadata[FLAG_KEY]) for f in dataclasses.fields(cls) if FLAG_KEY in f.metadata]


def flag_values(config: Any) -> dict[str, Any]:
    """A config's flag fields and their values, by field name."""
    return {f.name: getattr(config, f.name) for f, _ in flag_fields(type(config))}


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def field_default(field: dataclasses.Field) -> Any:
    """The field's default; None for a computed one (the config fills it in when not given)."""
    return None if field.default is dataclasses.MISSING else field.default


def show_default(value: Any, unit: str) -> str:
    if unit in ("bytes", "count") and isinstance(value, int) and value >= 1024:
        for size, prefix in ((1 << 30, "Gi"), (1 << 20, "Mi"), (1 << 10, "Ki")):
            if value % size == 0:
                return f"{value // size} {prefix}{'B' if unit == 'bytes' else ''}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def add_flags(
    parser: argparse.ArgumentParser,
    configs: Sequence[type],
    *,
    groups: Sequence[str],
    topics: Iterable[str] | None = None,
    group_titles: Mapping[str, str] | None = None,
    made: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of `configs`' fields, one argparse group per name in `groups` (in that
    order; `group_titles` may rename groups, several into one). `topics`: only the fields of
    those topics (e.g. `encode`'s share of the media flags). `made`: argument groups already
    made, by title (a positional argument first in its group)."""
    wanted = None if topics is None else set(topics)
    titles = group_titles or {}
    by_title: dict[str, list[tuple[dataclasses.Field, FlagSpec]]] = {
        titles.get(g, g): [] for g in groups
    }
    for cls in configs:
        for field, spec in flag_fields(cls):
            if wanted is not None and spec.topic not in wanted:
                continue
            title = titles.get(spec.group, spec.group)
            if spec.group not in groups:
                raise ValueError(f"{cls.__name__}.{field.name}: no group {spec.group!r}")
            by_title[title].append((field, spec))
    for title, entries in by_title.items():
        if not entries:
            continue
        group = (made or {}).get(title) or parser.add_argument_group(title)
        a = group.add_argument
        for field, spec in entries:
            a(flag_name(field), *spec.aliases, **_argparse_kwargs(field, spec))


def _argparse_kwargs(field: dataclasses.Field, spec: FlagSpec) -> dict[str, Any]:
    default = field_default(field)
    kwargs: dict[str, Any] = {
        "dest": field.name,
        "default": default,
        "help": spec.help.replace("{default}", show_default(default, spec.unit)),
    }
    if spec.required:
        kwargs["required"] = True
        del kwargs["default"]
    if spec.action is not None:
        kwargs["action"] = spec.action
    else:
        for key in ("type", "choices", "nargs", "metavar"):
            value = getattr(spec, key)
            if value is not None:
                kwargs[key] = value
    if spec.action is argparse.BooleanOptionalAction and spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if spec.choices is not None:
        kwargs["choices"] = spec.choices
    return kwargs


def parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` whose ValueError message becomes the usage error as it is."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def values_from(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The keyword arguments of `cls` the parsed flags hold. A None for a field whose default
    is computed (a factory) is left out, so the config computes it."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not hasattr(namespace, field.name):
            continue
        value = getattr(namespace, field.name)
        if value is None and field.default_factory is not dataclasses.MISSING:
            continue
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return values


def check_positive(name: str, value: float | None, *, optional: bool = False) -> None:
    """ValueError naming the flag unless `value` > 0 (None allowed when `optional`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value!r}")


def check_seconds(name: str, value: float) -> None:
    if not 0 < value <= 24 * 3600:
        raise ValueError(
            f"--{name.replace('_', '-')} must be > 0 and at most a day (in seconds), got {value}"
        )


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name.replace('_', '-')} must be one of {choices}, got {value!r}")


def check_non_empty(name: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"--{name.replace('_', '-')} must not be empty")
