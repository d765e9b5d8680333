"""Configuration resolution, in one place: flags > P2PTRAIN_* environment > TOML > defaults.

Each component owns a small dataclass with field docs and `__post_init__` validation
(NodeConfig, DHTConfig, ...). `resolve` fills one such dataclass from the four sources; a
value that cannot be parsed, or that the dataclass rejects, raises ConfigError naming the
source, so the CLI can print one line of advice. Given a `sources` dict, it also records
where each field's value came from (`describe` turns that into what `-v` / `--show-config`
print), so a user can see the configuration a node actually runs with.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "P2PTRAIN_"


class ConfigError(ValueError):
    pass


def load_toml(path: str | os.PathLike | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


def _parse(text: str, typ: Any, where: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        return [_parse(part.strip(), inner, where) for part in text.split(",") if part.strip()]
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if text == "" or text.lower() == "none":
            return None
        return _parse(text, args[0], where)
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typ in (int, float, str):
            return typ(text)
    except ValueError:
        raise ConfigError(f"{where}: cannot parse {text!r} as {typ.__name__}") from None
    return text


def resolve(cls: type, flags: Mapping[str, Any] | None = None, toml: Mapping[str, Any] | None = None,
            section: str = "", environ: Mapping[str, str] | None = None, sources: dict[str, str] | None = None):
    """Build `cls` from flags (None = not given) > env > toml[section] > defaults.

    `sources`, when given, is filled with field name -> where its value came from: "flag",
    the environment variable's name, "file [section]", or "default"."""
    flags = flags or {}
    environ = os.environ if environ is None else environ
    table = (toml or {}).get(section, {}) if section else (toml or {})
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        env_name = ENV_PREFIX + (f"{section}_{f.name}" if section else f.name).upper()
        if flags.get(f.name) is not None:
            values[f.name], origin[f.name] = flags[f.name], "flag"
        elif env_name in environ:
            values[f.name] = _parse(environ[env_name], hints[f.name], f"${env_name}")
            origin[f.name] = f"${env_name}"
        elif f.name in table:
            values[f.name], origin[f.name] = table[f.name], f"file [{section}]" if section else "file"
        else:
            origin[f.name] = "default"
    unknown = set(table) - {f.name for f in dataclasses.fields(cls)} if isinstance(table, dict) else set()
    unknown = {k for k in unknown if not isinstance(table.get(k), dict)}
    if unknown:
        raise ConfigError(f"unknown setting(s) in [{section or 'top level'}]: {', '.join(sorted(unknown))}")
    try:
        obj = cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {section or cls.__name__} settings: {exc}") from None
    if sources is not None:
        sources.update(origin)
    return obj


def describe(obj: Any, sources: Mapping[str, str], section: str = "") -> list[tuple[str, Any, str]]:
    """("[section] field", value as resolved, source) for each field of a resolved config."""
    prefix = f"[{section}] " if section else ""
    return [(prefix + f.name, getattr(obj, f.name), sources.get(f.name, "default")) for f in dataclasses.fields(obj)]
