"""Configuration files: ``--config FILE.toml`` in, the effective configuration out.

A file sets options by their long names, one per line (``limit-train = 4096``, ``hidden = [512, 256]``
or ``hidden = "512,256"``, ``nesterov = true``); the command line overrides it. A key that is no option,
or a value of the wrong type, is a UsageError naming the key. :func:`to_toml` writes a configuration
as such a file, which :func:`read_config` reads back to the same values: what ``--print-config``
prints and what a run writes beside its metrics and checkpoints. Stdlib only (``tomllib``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from mpisgd.config import ALIASES, GROUPS, Config, UsageError, _parse_int_tuple

FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# every spelling a key may take: the long option (limit-train), the field (limit_train), an alias (bucket-mb)
_NAMES = {**{n.replace("_", "-"): n for n in FIELDS}, **{n: n for n in FIELDS},
          **{a.lstrip("-"): n for n, aliases in ALIASES.items() for a in aliases}}


def _toml() -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise UsageError("--config needs Python >= 3.11 (tomllib) or the tomli package: pip install tomli") \
                from None
    return tomllib


def read_config(path: str) -> dict[str, Any]:
    """The options a TOML file sets, as Config field names and values (UsageError naming what is wrong)."""
    toml = _toml()
    try:
        with open(path, "rb") as f:
            table = toml.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except toml.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML ({exc})") from None
    return values(table, f"--config {path}")


def values(table: dict[str, Any], where: str) -> dict[str, Any]:
    """Config field -> value for the keys of ``table`` (a parsed TOML document)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            raise UsageError(f"{where}: [{key}] is a table; options go at the top level, one per line")
        name = _NAMES.get(key)
        if name is None:
            close = difflib.get_close_matches(key.replace("_", "-"), [n.replace("_", "-") for n in FIELDS], n=1)
            raise UsageError(f"{where}: {key!r} is not an option" + (f"; did you mean {close[0]!r}?" if close else
                             "; python -m mpisgd.train --help lists them"))
        if name in out:
            raise UsageError(f"{where}: {key!r} sets {name.replace('_', '-')!r} a second time")
        out[name] = _convert(FIELDS[name], key, value, where)
    return out


def _kind(f: dataclasses.Field) -> tuple[str, bool]:
    """The field's base type (bool, int, float, str, tuple) and whether it may be unset (None)."""
    text = f.type if isinstance(f.type, str) else str(f.type)
    base = text.split("|")[0].strip()
    return ("tuple" if base.startswith("tuple") else base), "None" in text


def _convert(f: dataclasses.Field, key: str, value: Any, where: str) -> Any:
    kind, _ = _kind(f)
    got = _TOML_TYPES.get(type(value).__name__, type(value).__name__)
    wrong = f"{where}: {key} must be {_WANT[kind]}, got {got} {json.dumps(value, default=str)}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageError(wrong)
        return value
    if isinstance(value, bool):  # TOML's true is no number
        raise UsageError(wrong)
    if kind == "int":
        if not isinstance(value, int):
            raise UsageError(wrong)
        return value
    if kind == "float":
        if not isinstance(value, int | float):
            raise UsageError(wrong)
        return float(value)
    if kind == "tuple":
        if isinstance(value, str):
            try:
                return _parse_int_tuple(value)
            except Exception:  # argparse's error type: say it in this file's terms
                raise UsageError(wrong) from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        raise UsageError(wrong)
    if not isinstance(value, str):
        raise UsageError(wrong)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"{where}: {key} must be one of {', '.join(choices)}, got {value!r}")
    return value


_TOML_TYPES = {"str": "string", "int": "integer", "bool": "boolean", "list": "array", "float": "float"}
_WANT = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
         "tuple": 'a list of integers ([1024, 1024] or "1024,1024")'}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(map(str, v)) + "]"
    if isinstance(v, float):
        return repr(v)  # shortest round-trip form: 0.1, 25.0, 0.0005, 1e-05
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's


def to_toml(cfg: Config, header: str = "") -> str:
    """``cfg`` as a TOML file that --config reads back to the same values, grouped as --help groups
    them. Options that are not set (None) appear as comments."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for title, names in GROUPS.items():
        lines.append(f"\n# {title}")
        for name in names:
            key, v = name.replace("_", "-"), getattr(cfg, name)
            lines.append(f"# {key} = (not set)" if v is None else f"{key} = {_value(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def copies(cfg: Config) -> list[Path]:
    """Where a run writes its effective configuration: beside the metrics file and in the checkpoint
    directory (rank 0)."""
    out = []
    if cfg.metrics_file:
        out.append(Path(f"{cfg.metrics_file}.config.toml"))
    if cfg.checkpoint_dir:
        out.append(Path(cfg.checkpoint_dir) / "config.toml")
    return out
