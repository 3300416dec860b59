"""The command line and configuration files: ``python -m mpisgd.train`` options in, the effective
configuration out.

Every field of :class:`~mpisgd.config.Config` becomes a flag (``batch_size`` -> ``--batch-size``), its
comment string the help. ``--config FILE.toml`` sets options by their long names, one per line
(``limit-train = 4096``, ``hidden = [512, 256]`` or ``hidden = "512,256"``, ``nesterov = true``); the
command line overrides it. Unknown keys and flags and values of the wrong type are errors
(:class:`UsageError`, naming them), never silently ignored. :func:`to_toml` writes a configuration as
such a file, which :func:`read_config` reads back to the same values: what ``--print-config`` prints and
what a run writes beside its metrics and checkpoints. Stdlib only (``argparse``, ``tomllib``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import stat
import sys
from typing import Any

from mpisgd.config import ALIASES, GPT_OPTIONS, GROUPS, MODEL_DEFAULTS, OPTIMIZER_OPTIONS, Config, parse_int_tuple
from mpisgd.errors import UsageError


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing and exiting, and prints only on rank 0."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def _print_message(self, message: str, file: Any = None) -> None:
        if not self.quiet:
            super()._print_message(message, file)


def version_line() -> str:
    """What ``--version`` prints: mpisgd's version and those of the libraries a bug report needs (read from the
    installed packages' metadata: nothing is imported, so MPI does not start and the pinning still holds)."""
    from importlib import metadata  # noqa: PLC0415 - only to print the version

    from mpisgd import __version__  # noqa: PLC0415

    def installed(name: str) -> str:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} not installed"

    found = ", ".join(installed(name) for name in ("numpy", "mpi4py", "torch"))
    return f"mpisgd {__version__} (Python {sys.version.split()[0]}; {found})"


class _Version(argparse.Action):
    """argparse's version action, its line made only when asked (the packages' metadata is read then)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:
        parser._print_message(version_line() + "\n", sys.stdout)
        parser.exit()


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: :func:`version_line`, then exit 0 (argparse's SystemExit, as --help)."""
    parser.add_argument("--version", action=_Version, help="print mpisgd's version and its libraries', and exit")


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m mpisgd.train",
        description="Synchronous data-parallel SGD over MPI. Launch with: mpiexec -n K python -m mpisgd.train",
        quiet=quiet, allow_abbrev=False,
    )
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for title, names in GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add_option(group, fields[name])
    files = parser.add_argument_group("configuration file")
    files.add_argument("--config", metavar="FILE.toml", action="append", help="read options from this TOML file, "
                       "by their long names (limit-train = 4096); the command line overrides it (docs/api.md)")
    files.add_argument("--print-config", action="store_true", help="print the effective configuration as "
                       "TOML that --config reads, and exit")
    add_version(parser)
    return parser


def _add_option(parser: Any, f: dataclasses.Field) -> None:
    """One field of Config as a command-line option (its help, default, type and choices)."""
    flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
    help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {_show(f.default)}"
                                      + "".join(f"; {_show(d[f.name])} for --model {m}"
                                                for m, d in MODEL_DEFAULTS.items() if f.name in d) + ")")
    kind = f.type if isinstance(f.type, str) else str(f.type)
    if f.name in SWITCH_LEVELS:  # --reproducible [LEVEL], --no-reproducible
        level = SWITCH_LEVELS[f.name]
        parser.add_argument(*flags, f"--no-{flags[0][2:]}", dest=f.name, nargs="?", action=_SwitchWithLevel,
                            level_dest=level, choices=FIELDS[level].metadata["choices"], default=f.default,
                            help=help_text, metavar="LEVEL")
    elif kind in ("bool", "bool | None"):  # None: decided at start-up (the help says how)
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
    elif kind.startswith("tuple"):
        parser.add_argument(*flags, type=parse_int_tuple, default=f.default, help=help_text, metavar="N,N")
    else:
        base = kind.split("|")[0].strip()
        conv = {"int": int, "float": float, "str": str}[base]
        parser.add_argument(*flags, type=conv, default=f.default, choices=f.metadata["choices"],
                            help=help_text, metavar=None if f.metadata["choices"] else base.upper())


class _SwitchWithLevel(argparse.Action):
    """``--NAME`` turns the option on, ``--NAME LEVEL`` also sets its level field (``--reproducible portable``),
    ``--no-NAME`` turns it off."""

    def __init__(self, option_strings: list[str], dest: str, level_dest: str = "", choices: Any = None,
                 **kwargs: Any) -> None:
        self.level_dest, self.levels = level_dest, tuple(choices or ())
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if value is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        setattr(namespace, self.dest, True)
        if value is not None:
            if value not in self.levels:
                parser.error(f"{option_string}: the level must be one of {', '.join(self.levels)}, got {value!r}")
            setattr(namespace, self.level_dest, value)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def parse_config(argv: list[str] | None = None, quiet: bool = False) -> Config:
    """Parse and validate the command line (and the --config file it names, which it overrides). Raises
    UsageError; prints --help (and --print-config's TOML, then SystemExit) unless quiet.

    ``cfg.given`` holds the fields set on the command line or in the file (a resumed run derives the
    others); ``cfg.config_file`` the file's path, or None."""
    parser = build_parser(quiet)
    ns = parser.parse_args(argv)
    config = _one_config(ns.config)
    from_file: dict[str, Any] = {}
    if config:
        from_file = read_config(config)
        parser.set_defaults(**from_file)
        ns = parser.parse_args(argv)
    names = {f.name for f in dataclasses.fields(Config)}
    quiet_parser = build_parser(quiet=True)
    quiet_parser.set_defaults(**dict.fromkeys(names, _UNSET))
    given = {k for k, v in vars(quiet_parser.parse_args(argv)).items() if v is not _UNSET and k in names}
    on_line = set(given)
    given |= set(from_file)
    values = {k: v for k, v in vars(ns).items() if k in names}
    values.update(_model_defaults(values, given))
    stale, overridden = _overridden_in_file(values, from_file, on_line, config)
    given -= stale  # put back to their defaults: as if the file had not set them
    _no_option_left_unread(values, given, on_line)
    cfg = Config(**values)
    cfg.validate()
    _none_ignored(values, given, set(from_file) - on_line, config)
    cfg.given = given  # type: ignore[attr-defined]
    cfg.config_file = config  # type: ignore[attr-defined]
    cfg.option_warnings = overridden + _other_models_recipe(values, from_file, on_line,  # type: ignore[attr-defined]
                                                            config)
    if ns.print_config and not quiet:
        for warning in cfg.option_warnings:  # type: ignore[attr-defined]
            print(f"mpisgd: warning: {warning}", file=sys.stderr, flush=True)
    if ns.print_config:
        if not quiet:
            print(to_toml(cfg, "mpisgd's configuration: python -m mpisgd.train --config FILE.toml reads it (the "
                                "command line overrides it)"), end="", flush=True)
        raise SystemExit(0)
    return cfg


def _no_option_left_unread(values: dict[str, Any], given: set[str], on_line: set[str]) -> None:
    """UsageError where an option is given a value of its own that the run would not read: a GPT option with
    another model, a reproducible level without --reproducible, on the command line or in a file that does not set
    it (the defaults pass, so that --print-config's file, which writes every field, reads back; a file's level
    with reproducible = false or --no-reproducible too)."""
    level = values["reproducible_level"]
    stray_level = level != FIELDS["reproducible_level"].default and not values["reproducible"]
    if stray_level and ("reproducible_level" in on_line or "reproducible" not in given):
        raise UsageError(f"--reproducible-level {level} without --reproducible: nothing would be reproducible; pass "
                         f"--reproducible {level}")
    if values["model"] == "gpt":
        return
    stray = [k for k in GPT_OPTIONS if k in given and values[k] != FIELDS[k].default]
    if stray:
        named = ", ".join(f"--{k.replace('_', '-')} {values[k]}" for k in stray)
        own = " (a model of your own has its own dropout: nn.Dropout, mpisgd.nn.Dropout)" \
            if "dropout" in stray and ":" in values["model"] else ""
        raise UsageError(f"{named}: for --model gpt only; --model {values['model']} does not read "
                         f"{'it' if len(stray) == 1 else 'them'}{own}")


def _other_models_recipe(values: dict[str, Any], from_file: dict[str, Any], on_line: set[str],
                         config: str | None) -> list[str]:
    """A warning where --model on the command line replaces the file's model and the file's values of the
    recipe's options (its lr, epochs, weight decay...) are not this model's recipe: they count as given, so
    the file's model's recipe runs with this model, which is rarely meant."""
    model, theirs = values["model"], from_file.get("model")
    if "model" not in on_line or theirs in (None, model):
        return []
    recipe = {**{k: FIELDS[k].default for d in MODEL_DEFAULTS.values() for k in d}, **MODEL_DEFAULTS.get(model, {})}
    kept = [k for k in recipe if k in from_file and k not in on_line and from_file[k] != recipe[k]]
    if not kept:
        return []
    return [f"--config {config} is a --model {theirs} configuration: its "
            + ", ".join(f"{k.replace('_', '-')} = {_show(from_file[k])}" for k in kept)
            + f" run with --model {model}, whose own recipe is "
            + ", ".join(f"{k.replace('_', '-')} = {_show(recipe[k])}" for k in kept)
            + " (pass those on the command line, or drop them from the file)"]


def _one_config(paths: list[str] | None) -> str | None:
    """The one --config file (a second one would silently replace the first: refused)."""
    if paths and len(paths) > 1:
        raise UsageError(f"--config given {len(paths)} times ({', '.join(paths)}): give one file (the command line "
                         "overrides it; merge the files into one)")
    return paths[0] if paths else None


def _recipe(model: str, optimizer: str) -> dict[str, Any]:
    """The stock model's recipe, an update rule's own options (the GPT's beta2 and weight-decay-on for AdamW)
    only where ``optimizer`` reads them."""
    return {k: v for k, v in MODEL_DEFAULTS.get(model, {}).items()
            if optimizer in OPTIMIZER_OPTIONS.get(k, (optimizer,))}


def _model_defaults(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The stock model's recipe for the options not given (with the optimizer it names, where not given)."""
    optimizer = values["optimizer"] if "optimizer" in given else \
        MODEL_DEFAULTS.get(values["model"], {}).get("optimizer", values["optimizer"])
    return {k: v for k, v in _recipe(values["model"], optimizer).items() if k not in given}


def _default(name: str, values: dict[str, Any]) -> Any:
    """The value ``name`` takes when not given: the stock model's recipe's, else the field's."""
    return _recipe(values["model"], values["optimizer"]).get(name, FIELDS[name].default)


def _overridden_in_file(values: dict[str, Any], from_file: dict[str, Any], on_line: set[str],
                        config: str | None) -> tuple[set[str], list[str]]:
    """The --config file's values that an option on the command line leaves unread (the file's MLP widths with
    --model cnn, its AdamW betas with --optimizer sgd, its resume-allow with --resume no, its step decay's epochs
    with --decay cosine): put back to their defaults in ``values``, each named in a warning; the run goes on.
    (Where nothing on the command line decided it, the file contradicts itself: refused, as the command line
    is.) Returns their names and the warnings."""
    stale, notes = set(), []
    for name, deciders, reader in _READ_BY + _DECIDED_ELSEWHERE:
        if name not in from_file or name in on_line or not set(deciders) & on_line:
            continue
        why = reader(values)
        if why and values[name] != _default(name, values):
            notes.append(f"{name.replace('_', '-')} = {_show(values[name])} from --config {config} is ignored, as "
                         f"the command line leaves it unread: {why}")
            values[name] = _default(name, values)
            stale.add(name)
    return stale, notes


def _none_ignored(values: dict[str, Any], given: set[str], in_file: set[str], config: str | None) -> None:
    """UsageError naming every option given a value of its own (not its default) that the run would not read:
    the MLP's widths with another model, an update rule's option with another rule, a step decay's epochs with
    another decay, checkpoint options without --checkpoint-dir, ... (a file's defaults pass, so that the file
    --print-config writes, which sets every option, reads back)."""
    stray = []
    for name, _, reader in _READ_BY:
        if name in given and values[name] != _default(name, values) and (why := reader(values)):
            where = f"from --config {config}; " if name in in_file else ""
            stray.append(f"--{name.replace('_', '-')} {_show(values[name])} ({where}{why})")
    if stray:
        one = len(stray) == 1
        raise UsageError(f"{' and '.join(stray)} would do nothing in this run: drop {'it' if one else 'them'}, or "
                         f"choose what {'reads it' if one else 'reads them'}")


def _optimizer_reads(name: str) -> Any:
    readers = OPTIMIZER_OPTIONS[name]
    return lambda v: "" if v["optimizer"] in readers else \
        f"for --optimizer {' or '.join(readers)}, not {v['optimizer']}"


def _no_warmup(v: dict[str, Any]) -> bool:
    return v["warmup_steps"] == 0 or (v["warmup_steps"] is None and v["warmup_epochs"] == 0)


WARMUP = ("warmup_steps", "warmup_epochs", "model")
OPTIMIZER = ("optimizer", "model")  # the GPT's recipe sets its optimizer

# option, the options that decide whether the run reads it, why it would not ("" where it would)
_READ_BY: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("hidden", ("model",),
     lambda v: "" if v["model"] == "mlp" else f"the MLP's widths; --model {v['model']} does not read them"),
    ("synthetic_samples", ("dataset", "data"),
     lambda v: "" if v["dataset"] == "synthetic" else "for --dataset synthetic only"),
    ("data_dir", ("data", "dataset"), lambda v: "with --data, that file is read" if v["data"] else
     "" if v["dataset"] == "fashion-mnist" else "Fashion-MNIST's directory; --dataset synthetic does not read it"),
    ("test_every_epoch", ("val_split", "model"), lambda v: "" if v["val_split"] > 0 else
     "for runs with --val-split only (without it the test set is scored every epoch)"),
    *((name, OPTIMIZER, _optimizer_reads(name)) for name in ("momentum", "trust_coef", "beta1", "beta2", "eps")),
    ("decay_epochs", ("decay",), lambda v: "" if v["decay"] == "step" else f"for --decay step, not {v['decay']}"),
    ("decay_factor", ("decay",), lambda v: "" if v["decay"] == "step" else f"for --decay step, not {v['decay']}"),
    ("warmup_from", WARMUP, lambda v: "there is no warmup" if _no_warmup(v) else ""),
    *((name, ("checkpoint_dir",), lambda v: "" if v["checkpoint_dir"] else "there is no --checkpoint-dir")
      for name in ("checkpoint_every", "checkpoint_keep", "overwrite_checkpoints")),
    ("resume_allow", ("resume",), lambda v: "there is no --resume" if v["resume"] == "no" else ""),
)
# the same for options refused elsewhere when given on the command line (Config.validate, the GPT's options,
# the data's window): from a file whose reader the command line changed, put back with a warning too
_DECIDED_ELSEWHERE: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    *((name, OPTIMIZER, _optimizer_reads(name)) for name in ("nesterov", "momentum_correction", "weight_decay_on")),
    *((name, ("model",), lambda v: "" if v["model"] == "gpt" else f"for --model gpt only, not {v['model']}")
      for name in GPT_OPTIONS),
    ("context", ("model",), lambda v: f"the window of text or tokens; --model {v['model']} reads images"
     if v["model"] in ("mlp", "cnn", "resnet") else ""),
)


_UNSET = object()


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
SWITCH_LEVELS = {"reproducible": "reproducible_level"}  # a switch that may name its level field's value


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


MAX_CONFIG_BYTES = 1 << 20  # a configuration is a few KiB


def read_config(path: str) -> dict[str, Any]:
    """The options a TOML file sets, as Config field names and values (UsageError naming what is wrong).
    Only a regular file is read (every rank reads it: a FIFO, a terminal or /dev/stdin under mpiexec would
    block a rank for ever), opened without blocking, at most MAX_CONFIG_BYTES, as UTF-8 text."""
    toml = _toml()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"--config {path} is not a regular file (a FIFO, a device or standard input is never "
                             "read: every rank reads the file itself); give a TOML file")
        raw = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a configuration file")
    try:
        table = toml.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                         "TOML files are UTF-8") from None
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
                return parse_int_tuple(value)
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
    them. Options that are not set (None) appear as comments, and so does --accum-steps with --global-batch
(m follows from B at start-up, on any number of ranks)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for title, names in GROUPS.items():
        lines.append(f"\n# {title}")
        for name in names:
            key, v = name.replace("_", "-"), getattr(cfg, name)
            if name == "accum_steps" and cfg.global_batch is not None:  # m follows from B, k and b at start-up
                lines.append(f"# {key} = (follows from global-batch, the number of ranks and batch-size)")
            else:
                lines.append(f"# {key} = (not set)" if v is None else f"{key} = {_value(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"
