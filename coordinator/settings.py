"""The coordinator's effective configuration: one TOML file, the environment and
flags, merged over the dataclass defaults and validated before anything starts.

Precedence is defaults < file < environment < flags. The file has a
``[coordinator]`` table (``coordinator.config.CoordinatorConfig``), a
``[scheduler]`` table (``scheduler.config.SchedulerConfig``), an ``[advisor]``
table (the rebalance advisor's thresholds, ``scheduler.advisor.AdvisorConfig``),
a ``[predictor]`` table (``scheduler.predictor.PredictorConfig``) and a
``[memory_growth]`` table (``scheduler.memgrowth.MemoryGrowthConfig``); the
environment uses ``GPULB_<OPTION>`` and ``GPULB_<TABLE>_<OPTION>`` for the
others; flags exist for the coordinator's options. Everything is derived by walking the dataclasses'
fields, so a field added there is configurable, documented in
``--print-config`` and reported by SIGHUP's diff without touching this module.
Every error names the option and where its value came from (the file's path,
the variable or the flag), and one run names every problem it finds
(``ConfigErrors``), not only the first.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from coordinator.config import CoordinatorConfig
from protos.runtime import LOG_LEVELS
from scheduler.advisor import AdvisorConfig
from scheduler.config import LEASE_S_MAX, SchedulerConfig
from scheduler.errors import InvalidArgument, InvalidWeight, UnknownPolicy
from scheduler.policies import POLICIES, make_policy
from scheduler.memgrowth import MemoryGrowthConfig
from scheduler.predictor import PredictorConfig

__all__ = [
    "ConfigErrors",
    "Bounds",
    "ConfigError",
    "Option",
    "Section",
    "SECTIONS",
    "Settings",
    "add_settings_flags",
    "diff_settings",
    "env_names",
    "flag_overrides",
    "load_settings",
    "options",
    "render_settings",
]


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or out of range.

    ``option`` is the dotted TOML path (``coordinator.listen``,
    ``scheduler.class_weights[2]``), ``source`` where the value came from
    (``file:/etc/gpulb/coordinator.toml``, ``env:GPULB_LISTEN``, ``flag``,
    ``default``), ``message`` what is wrong with it.
    """

    def __init__(self, option: str, source: str, message: str) -> None:
        self.option = option
        self.source = source
        self.message = message
        super().__init__(f"{_describe_source(source)}: {option}: {message}")


class ConfigErrors(ConfigError):
    """Several problems at once: the first is this error's ``option``,
    ``source`` and ``message``; ``errors`` holds them all, and the text
    names every one, one a line (each as its own ``ConfigError`` says it),
    after a line that counts them, so that a configuration with several
    mistakes (values whose range tightened in an upgrade, QA pass 24; an
    unknown option, a value of the wrong type, a bad variable or flag) is
    fixed in one pass, not one restart per mistake."""

    def __init__(self, errors: list[ConfigError]) -> None:
        first = errors[0]
        super().__init__(first.option, first.source, first.message)
        self.errors = list(errors)
        self.args = (f"{len(self.errors)} problems in the configuration:\n"
                     + "\n".join(f"  {e}" for e in self.errors),)

    def __str__(self) -> str:
        return self.args[0]


def _describe_source(source: str) -> str:
    kind, _, detail = source.partition(":")
    if kind == "file":
        return detail
    if kind == "env":
        return f"environment variable {detail}"
    if kind == "flag":
        return f"flag {detail}" if detail else "command-line flag"
    return "default value"


# ---- the option table, walked from the dataclasses ------------------------------------


@dataclass(frozen=True)
class Section:
    """One TOML table and the dataclass it fills."""

    name: str
    cls: type
    env_prefix: str
    #: whether each option also gets a command-line flag
    flags: bool


SECTIONS: tuple[Section, ...] = (
    Section("coordinator", CoordinatorConfig, "GPULB_", flags=True),
    Section("scheduler", SchedulerConfig, "GPULB_SCHEDULER_", flags=False),
    Section("advisor", AdvisorConfig, "GPULB_ADVISOR_", flags=False),
    Section("predictor", PredictorConfig, "GPULB_PREDICTOR_", flags=False),
    Section("memory_growth", MemoryGrowthConfig, "GPULB_MEMORY_GROWTH_", flags=False),
)


def _number(value: float) -> str:
    """``value`` as an operator writes it: 1000000, not 1e+06 or 1000000.0."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a number: ``low``/``high`` (None: unbounded), each
    included unless ``low_open``/``high_open``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Bounds | None":
        """From a field's ``ge``/``gt``/``le``/``lt`` metadata; None without any."""
        low = meta.get("gt", meta.get("ge"))
        high = meta.get("lt", meta.get("le"))
        if low is None and high is None:
            return None
        return cls(low, high, "gt" in meta, "lt" in meta)

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def describe(self, unit: str = "", *, verb: bool = True) -> str:
        """``in (0, 1]``, ``> 0 s``, ``>= 5 readings``: what a message says
        (without ``verb``, ``(0, 1]``: the rendered configuration's range)."""
        unit = f" {unit}" if unit else ""
        if self.low is not None and self.high is not None:
            return (f"{'in ' if verb else ''}{'(' if self.low_open else '['}{_number(self.low)}, "
                    f"{_number(self.high)}{')' if self.high_open else ']'}{unit}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}{unit}"
        return f"{'<' if self.high_open else '<='} {_number(self.high)}{unit}"


@dataclass(frozen=True)
class Option:
    """One configurable field, with everything needed to parse and document it."""

    section: str
    name: str
    type: Any
    default: Any
    help: str
    unit: str
    env: str
    flag: str | None
    choices: tuple[str, ...] | None
    #: the allowed range of a number option (None: only the unit's >= 0, if it has one)
    bounds: Bounds | None = None
    #: ``choices`` match in any case and are stored as spelled there
    ignore_case: bool = False

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


# Units by name suffix, for fields that carry no ``unit`` metadata (the
# scheduler's): their names already follow this convention.
_SUFFIX_UNITS = (("_ms", "ms"), ("_pct", "%"), ("_bytes", "bytes"), ("_s", "s"), ("_c", "°C"))

# Allowed values of a few string options until their field metadata carries
# ``choices`` itself (coordinator/config.py has them only in the help text;
# the policy names live in the registry).
_FALLBACK_CHOICES: Mapping[str, tuple[str, ...]] = {
    "coordinator.log_level": tuple(LOG_LEVELS),
    "coordinator.log_format": ("auto", "json", "console"),
    "scheduler.policy": tuple(POLICIES),
}
# Help for fields documented nowhere else.
_FALLBACK_HELP: Mapping[str, str] = {
    "scheduler.policy": "placement policy, by its registered name",
}
# Ranges of the other tables' options that their validate() leaves open and a
# value outside which breaks the coordinator at run time (the coordinator's
# own are declared on its fields, coordinator/config.py); as metadata.
_FALLBACK_BOUNDS: Mapping[str, Mapping[str, float]] = {
    # queue_head_limit: SchedulerConfig.validate refuses it too; declared here
    # so that --help and --print-config show the ranges
    "scheduler.queue_head_limit": {"ge": 0},
    "scheduler.lease_s": {"gt": 0, "le": LEASE_S_MAX},
    "scheduler.max_lease_extend_s": {"gt": 0, "le": LEASE_S_MAX},
}


def _source_comments(cls: type) -> dict[str, str]:
    """The ``#`` comment block above each field in the class source.

    SchedulerConfig documents its fields in comments, not metadata; reading
    them keeps ``--print-config`` in step with the code. A block covers the
    run of fields right below it (up to a blank line); ``# ---- title ----``
    separators are headings, not help.
    """
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines()[1:]
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    current = ""
    for line in lines:
        if not line.startswith("    ") or line.startswith("     "):
            if line.strip():
                continue  # continuation lines of a default or docstring
        stripped = line.strip()
        if not stripped:
            pending, current = [], ""
            continue
        if stripped.startswith(("def ", "@", "class ")):
            break
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if text.startswith("--"):
                pending, current = [], ""
            else:
                pending.append(text)
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match is None:
            continue
        if pending:
            current, pending = " ".join(pending), []
        if current:
            out[match.group(1)] = current
    return out


# Comments that open with their unit ("%²: variance of ...") give it that way.
_UNIT_PREFIX = re.compile(r"^(%²|%/min|%|s|ms|MiB|°C):\s+(.*)$")


def _unit_from_name(name: str) -> str:
    for suffix, unit in _SUFFIX_UNITS:
        if name.endswith(suffix):
            return unit
    return ""


def options(section: Section) -> list[Option]:
    """Every configurable field of ``section``, in declaration order."""
    hints = typing.get_type_hints(section.cls)
    comments = _source_comments(section.cls)
    result = []
    for f in dataclasses.fields(section.cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{section.cls.__name__}.{f.name} has no default; settings need one")
        meta = f.metadata
        key = f"{section.name}.{f.name}"
        choices = meta.get("choices") or _FALLBACK_CHOICES.get(key)
        help_text = meta.get("help") or comments.get(f.name) or _FALLBACK_HELP.get(key, "")
        unit = meta.get("unit") if "unit" in meta else _unit_from_name(f.name)
        prefixed = _UNIT_PREFIX.match(help_text) if "unit" not in meta else None
        if prefixed:
            unit, help_text = unit or prefixed.group(1), prefixed.group(2)
            help_text = help_text[:1].upper() + help_text[1:]
        result.append(
            Option(
                section=section.name,
                name=f.name,
                type=hints[f.name],
                default=default,
                help=help_text,
                unit=unit,
                env=f"{section.env_prefix}{f.name.upper()}",
                flag="--" + f.name.replace("_", "-") if section.flags else None,
                choices=tuple(choices) if choices else None,
                bounds=Bounds.from_metadata(meta) or Bounds.from_metadata(_FALLBACK_BOUNDS.get(key, {})),
                ignore_case=bool(meta.get("ignore_case")),
            )
        )
    return result


def env_names() -> dict[str, Option]:
    """Environment variable -> option; raises if two options would share a name."""
    index: dict[str, Option] = {}
    for section in SECTIONS:
        for opt in options(section):
            if opt.env in index:
                raise RuntimeError(f"{opt.key} and {index[opt.env].key} both map to ${opt.env}")
            index[opt.env] = opt
    return index


# ---- converting values by the field's type ----------------------------------------------


class _Invalid(Exception):
    """A value does not fit the option's type; the message says why."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _split_list(text: str) -> list[str]:
    text = text.strip()
    return [] if not text else [item.strip() for item in text.split(",")]


def _convert(value: Any, tp: Any, *, text: bool) -> Any:
    """``value`` as type ``tp``. With ``text``, ``value`` is a string from the
    environment or a flag (lists comma-separated, mappings ``k=v,k=v``);
    otherwise it is a TOML value, checked strictly (no ``"10"`` for 10)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if type(None) in args and text and value.strip().lower() in ("", "none"):
            return None
        errors = []
        for member in members:
            try:
                return _convert(value, member, text=text)
            except _Invalid as exc:
                errors.append(str(exc))
        raise _Invalid("; ".join(errors))
    if tp is Any:
        return value
    if tp is bool:
        if text:
            lowered = value.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
        elif isinstance(value, bool):
            return value
        raise _Invalid(f"expected true or false, got {value!r}")
    if tp is int:
        if text:
            try:
                return int(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Invalid(f"expected a whole number, got {value!r}")
    if tp is float:
        if text:
            try:
                return float(value.strip())
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Invalid(f"expected a number, got {value!r}")
    if tp is str:
        if text or isinstance(value, str):
            return value
        raise _Invalid(f"expected a string, got {value!r}")
    if origin in (tuple, list, frozenset, set):
        if text:
            items: list[Any] = _split_list(value)
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise _Invalid(f"expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(items) != len(args):
                raise _Invalid(f"expected {len(args)} values, got {len(items)}: {value!r}")
            elem_types = list(args)
        else:
            elem_types = [args[0] if args else Any] * len(items)
        converted = []
        for i, (item, elem) in enumerate(zip(items, elem_types)):
            try:
                converted.append(_convert(item, elem, text=text))
            except _Invalid as exc:
                raise _Invalid(f"item {i}: {exc}") from None
        if origin is frozenset:
            return frozenset(converted)
        if origin is set:
            return set(converted)
        return origin(converted)
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        key_type, value_type = args if args else (Any, Any)
        if text:
            pairs = []
            for item in _split_list(value):
                key, sep, raw = item.partition("=")
                if not sep or not key.strip():
                    raise _Invalid(f"expected KEY=VALUE[,KEY=VALUE...], got {item!r}")
                pairs.append((key.strip(), raw.strip()))
        elif isinstance(value, dict):
            pairs = list(value.items())
        else:
            raise _Invalid(f"expected a table, got {value!r}")
        out = {}
        for key, raw in pairs:
            try:
                out[_convert(key, key_type, text=True)] = _convert(raw, value_type, text=text)
            except _Invalid as exc:
                raise _Invalid(f"[{key}]: {exc}") from None
        return out
    raise TypeError(f"settings cannot parse values of type {tp!r}")


def _canonical(opt: Option, value: Any) -> Any:
    """``value`` spelled as its choice when the option ignores case."""
    if opt.ignore_case and opt.choices and isinstance(value, str):
        for choice in opt.choices:
            if choice.lower() == value.lower():
                return choice
    return value


def _check_value(opt: Option, value: Any) -> str | None:
    """Checks every option gets from its type and metadata; the message, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if opt.bounds is not None:
            if value not in opt.bounds:
                return f"must be {opt.bounds.describe(opt.unit)}, got {value!r}"
        elif opt.unit and value < 0:
            return f"must be >= 0 {opt.unit}, got {value!r}"
    if opt.choices is not None and value not in opt.choices:
        return f"must be one of {', '.join(opt.choices)}; got {value!r}"
    if opt.help.startswith("HOST:PORT") and isinstance(value, str):
        if value == "" and "empty" in opt.help:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            return f"expected HOST:PORT with a port in 0-65535, got {value!r}"
    return None


def section_from_text(name: str, assignments: Sequence[str]) -> Any:
    """The ``[name]`` table's dataclass from ``OPTION=VALUE`` strings, spelled
    as in the environment (lists comma-separated), every other option at its
    default, validated. ValueError naming the option when one is unknown,
    malformed, or its value does not convert or validate (a command's
    ``--advisor-set`` style override)."""
    section = next(s for s in SECTIONS if s.name == name)
    by_name = {opt.name: opt for opt in options(section)}
    changes: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or key not in by_name:
            raise ValueError(f"{assignment!r}: expected OPTION=VALUE with OPTION one of {', '.join(sorted(by_name))}")
        opt = by_name[key]
        try:
            value = _convert(text, opt.type, text=True)
        except _Invalid as exc:
            raise ValueError(f"{key}: {text!r}: {exc}") from None
        value = _canonical(opt, value)
        problem = _check_value(opt, value)
        if problem:
            raise ValueError(f"{key}: {problem}")
        changes[key] = value
    config = dataclasses.replace(section.cls(), **changes)
    config.validate()
    return config


# ---- loading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The effective configuration and where each value came from."""

    coordinator: CoordinatorConfig
    scheduler: SchedulerConfig
    advisor: AdvisorConfig
    predictor: PredictorConfig
    memory_growth: MemoryGrowthConfig
    #: ``section.option`` -> ``default`` | ``file:/path`` | ``env:GPULB_X`` | ``flag``
    sources: Mapping[str, str]
    config_path: str | None = None
    #: likely typos among ``GPULB_*`` variables, worth logging at start
    warnings: tuple[str, ...] = ()


def _suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _read_file(path: str) -> dict[str, Any]:
    source = f"file:{path}"
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("--config", source, f"cannot read the file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("(syntax)", source, f"not valid TOML: {exc}") from None


#: in ``load_settings``'s bookkeeping: a problem that no one table owns (an
#: unreadable file, an unknown table), after which no table's rules across
#: options are checked
_ALL_TABLES = "*"


def _file_values(
    path: str, data: dict[str, Any], by_section: dict[str, dict[str, Option]]
) -> tuple[dict[str, tuple[Any, str]], list[ConfigError], set[str]]:
    """The file's values that convert, every problem with the others (an
    unknown table or option, a value of the wrong type), and the tables
    those problems touch (``_ALL_TABLES`` for one no table owns)."""
    source = f"file:{path}"
    values: dict[str, tuple[Any, str]] = {}
    problems: list[ConfigError] = []
    touched: set[str] = set()
    for table, body in data.items():
        if table not in by_section:
            touched.add(_ALL_TABLES)
            if not isinstance(body, dict):
                homes = [s for s, opts in by_section.items() if table in opts]
                hint = f"; put it under [{homes[0]}]" if homes else _suggest_option(table, by_section)
                problems.append(ConfigError(table, source, f"options belong in a table ([{'], ['.join(by_section)}]){hint}"))
            else:
                problems.append(ConfigError(f"[{table}]", source, f"unknown table{_suggest(table, by_section)} (tables: {', '.join(by_section)})"))
            continue
        if not isinstance(body, dict):
            touched.add(table)
            problems.append(ConfigError(table, source, f"must be a table ([{table}]), got {body!r}"))
            continue
        opts = by_section[table]
        for key, raw in body.items():
            if key not in opts:
                elsewhere = [s for s, other in by_section.items() if s != table and key in other]
                hint = f"; it belongs in [{elsewhere[0]}]" if elsewhere else _suggest(key, opts)
                touched.update([table, *elsewhere[:1]])
                problems.append(ConfigError(f"{table}.{key}", source, f"unknown option{hint}"))
                continue
            opt = opts[key]
            try:
                values[opt.key] = (_convert(raw, opt.type, text=False), source)
            except _Invalid as exc:
                touched.add(table)
                problems.append(ConfigError(opt.key, source, str(exc)))
    return values, problems, touched


def _suggest_option(name: str, by_section: dict[str, dict[str, Option]]) -> str:
    return _suggest(name, [o for opts in by_section.values() for o in opts])


def load_settings(
    config_path: str | os.PathLike[str] | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < ``config_path`` < ``env`` < ``overrides`` and validate.

    ``overrides`` are the flags: ``{option: value}`` for coordinator options or
    ``{"section.option": value}`` for any; None values are skipped (a flag not
    given), strings are parsed like environment values. Raises ``ConfigError``
    for one problem, ``ConfigErrors`` naming every one for several: an
    unknown table or option, a value of the wrong type (in the file, a
    variable or a flag) and a value out of range are all found in one run,
    so that fixing a configuration is not one restart per mistake. Only a
    file that cannot be read or is not TOML hides the file's other problems
    (the variables and flags are still checked), and a table's rules across
    its options (``validate()``: memory_warn_pct below memory_reject_pct)
    are checked only once each of its values is taken.
    """
    by_section = {s.name: {o.name: o for o in options(s)} for s in SECTIONS}
    path = os.path.abspath(os.fspath(config_path)) if config_path is not None else None
    chosen: dict[str, tuple[Any, str]] = {}
    problems: list[ConfigError] = []
    #: tables with a value refused (or _ALL_TABLES): their rules across options wait for it
    touched: set[str] = set()
    if path is not None:
        try:
            data = _read_file(path)
        except ConfigError as exc:  # unreadable, or not TOML: the one problem the file can show
            problems.append(exc)
            touched.add(_ALL_TABLES)
        else:
            values, file_problems, file_touched = _file_values(path, data, by_section)
            chosen.update(values)
            problems += file_problems
            touched |= file_touched

    env_index = env_names()
    for name, opt in env_index.items():
        if name in env:
            source = f"env:{name}"
            try:
                chosen[opt.key] = (_convert(env[name], opt.type, text=True), source)
            except _Invalid as exc:
                problems.append(ConfigError(opt.key, source, str(exc)))
                touched.add(opt.section)
    warnings = []
    for name in sorted(env):
        if name.startswith("GPULB_") and name not in env_index:
            # Only near-misses: other GPULB_* variables (the CLI's GPULB_COORDINATOR,
            # GPULB_TRACES) are legitimately present and not ours to judge. The
            # shared prefix is left out of the comparison, or it alone would match.
            stems = {known[len("GPULB_"):]: known for known in env_index}
            close = difflib.get_close_matches(name[len("GPULB_"):], list(stems), n=1, cutoff=0.8)
            if close:
                warnings.append(f"environment variable {name} is not a setting; did you mean {stems[close[0]]}?")

    for raw_key, value in (overrides or {}).items():
        if value is None:
            continue
        section_name, dot, name = raw_key.rpartition(".")
        section_name = section_name if dot else SECTIONS[0].name
        opt = by_section.get(section_name, {}).get(name)
        if opt is None:
            problems.append(ConfigError(raw_key, "flag", "unknown option" + _suggest_option(name, by_section)))
            touched.add(section_name if section_name in by_section else _ALL_TABLES)
            continue
        try:
            text = isinstance(value, str) and opt.type is not str
            chosen[opt.key] = (_convert(value, opt.type, text=text), "flag")
        except _Invalid as exc:
            problems.append(ConfigError(opt.key, "flag", str(exc)))
            touched.add(opt.section)

    built: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for section in SECTIONS:
        kwargs = {}
        bad_values: list[ConfigError] = []  # every value out of range (or not a choice), not only the first
        for opt in by_section[section.name].values():
            value, source = chosen.get(opt.key, (opt.default, "default"))
            value = _canonical(opt, value)
            sources[opt.key] = source
            problem = _check_value(opt, value)
            if problem:
                bad_values.append(ConfigError(opt.key, source, problem))
                continue
            if opt.key in chosen:
                kwargs[opt.name] = value
        problems += bad_values
        # a table with a value refused is still checked, its refused values at
        # their defaults, but only for what each value breaks alone: a rule
        # across options would judge a default the operator meant to change
        # (memory_warn_pct = 95 against the default reject % when theirs was refused)
        partial = bool(bad_values) or section.name in touched or _ALL_TABLES in touched
        config = section.cls(**kwargs)
        found = _validate_all(section, config, sources, alone_only=partial)
        problems += found
        if not (partial or found):
            built[section.name] = config
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)
    return Settings(sources=sources, config_path=path, warnings=tuple(warnings), **built)


def _check_policy(config: SchedulerConfig) -> None:
    # The weights are only checkable by the policy they belong to; building it
    # here turns a typo in [scheduler] weights into a start (or reload) error
    # naming the file, not a failure at the first dispatch.
    try:
        make_policy(config.policy, config.weights)
    except UnknownPolicy as exc:
        raise InvalidArgument("policy", exc.message) from None
    except InvalidWeight as exc:
        raise InvalidArgument(exc.field, exc.message) from None


#: checks across a section's options beyond the dataclass's own ``validate()``
_SECTION_CHECKS: Mapping[str, Any] = {"scheduler": _check_policy}


def _precedence(source: str) -> int:
    return ("default", "file", "env", "flag").index(source.partition(":")[0])


def _validate_all(section: Section, config: Any, sources: Mapping[str, str], *, alone_only: bool) -> list[ConfigError]:
    """Every problem ``_validate`` finds, not only the first: a table's
    ``validate()`` stops at its first problem, so each option it names is put
    back to its default and the table checked again (QA pass 25: three
    mistakes in [scheduler] took three runs of --print-config). A problem
    whose message names another option of the table is a rule across options;
    ``alone_only`` leaves those out."""
    fields = {f.name: f for f in dataclasses.fields(section.cls)}
    problems: list[ConfigError] = []
    reset: set[str] = set()
    for _ in range(len(fields) + 1):
        try:
            _validate(section, config, sources)
            break
        except ConfigError as exc:
            base = re.sub(r"\[.*$", "", exc.option.partition(".")[2])
            across = any(re.search(rf"\b{re.escape(name)}\b", exc.message) for name in fields if name != base)
            if not (alone_only and across):
                problems.append(exc)
            field = fields.get(base)
            if field is None or base in reset:
                break  # not one option's (or put back already): nothing more to learn
            reset.add(base)
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            config = dataclasses.replace(config, **{base: default})
    return problems


def _validate(section: Section, config: Any, sources: Mapping[str, str]) -> None:
    validate = getattr(config, "validate", None)
    extra = _SECTION_CHECKS.get(section.name)
    try:
        if validate is not None:
            validate()
        if extra is not None:
            extra(config)
    except (InvalidArgument, ValueError) as exc:
        field = getattr(exc, "field", "")
        message = getattr(exc, "message", str(exc))
        named = re.match(r"^(\w+): (.*)$", message, re.S) if not field else None
        if named and named.group(1) in {f.name for f in dataclasses.fields(section.cls)}:
            # plain ValueErrors of the advisor's and predictor's validate() open with the field
            field, message = named.group(1), named.group(2)
        base = re.sub(r"\[.*$", "", field)
        key = f"{section.name}.{base}"
        source = sources.get(key, "default")
        if source == "default":
            # The named option kept its default, so a related one set somewhere
            # made it invalid (memory_warn_pct vs memory_reject_pct): blame the
            # layer the operator touched last and list what was set.
            changed = [(k, s) for k, s in sources.items() if s != "default" and k.startswith(section.name + ".")]
            if changed:
                source = max((s for _, s in changed), key=_precedence)
                listed = ", ".join(f"{k} ({_describe_source(s)})" for k, s in changed)
                message += f" ({base} is at its default; options set: {listed})"
        raise ConfigError(f"{section.name}.{field}" if field else section.name, source, message) from None


# ---- rendering, diffing, flags ----------------------------------------------------------------


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON's string escapes are a subset of TOML's basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (frozenset, set)):
        return "[" + ", ".join(_toml_value(v) for v in sorted(value)) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_key(key: Any) -> str:
    key = str(key)
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def render_settings(settings: Settings, *, commented_defaults: bool = False) -> str:
    """The effective configuration as TOML, one comment block per option.

    This is ``--print-config``: loading the output gives the same settings.
    With ``commented_defaults``, options still at their default are written
    as comments, which makes the reference example shipped in ``systemd/``
    (an operator uncomments what they change, and upgrades bring new defaults).
    """
    out = [
        "# gpulb coordinator configuration.",
        "#",
        "# Precedence: built-in defaults < this file < environment < command-line flags.",
        "# Environment: GPULB_<OPTION> for [coordinator], GPULB_<TABLE>_<OPTION> for the others",
        "# (GPULB_SCHEDULER_POLICY, GPULB_ADVISOR_HOT_PCT, ...);",
        "# lists are comma-separated (a,b,c), tables KEY=VALUE,KEY=VALUE.",
    ]
    if commented_defaults:
        out.append("# Every option is shown commented out at its default; uncomment to change it.")
        out.append("# (Generated from the code by `python -m coordinator.settings`.)")
    else:
        out.append("# Effective values, printed by `gpulb-coordinator --print-config`; 'source' says where each came from.")
    for section in SECTIONS:
        config = getattr(settings, section.name)
        out += ["", f"[{section.name}]"]
        for opt in options(section):
            value = getattr(config, opt.name)
            source = settings.sources.get(opt.key, "default")
            out.append("")
            for line in textwrap.wrap(opt.help, 86) or ["(no description)"]:
                out.append(f"# {line}")
            facts = [f"unit: {opt.unit}" if opt.unit else f"type: {_type_name(opt.type)}"]
            if opt.bounds is not None:
                facts.append(f"range: {opt.bounds.describe(verb=False)}")
            if opt.choices:
                facts.append(f"one of: {', '.join(opt.choices)}")
            facts.append(f"default: {_toml_value(opt.default) if opt.default is not None else 'unset'}")
            facts.append(f"env: {opt.env}")
            if opt.flag:
                facts.append(f"flag: {opt.flag}")
            out.append("# " + "; ".join(facts))
            if value is None:
                # TOML has no null: an unset optional value can only be left out.
                out.append(f"# source: {source}")
                out.append(f"# {opt.name} is unset")
                continue
            assignment = f"{opt.name} = {_toml_value(value)}"
            if commented_defaults and source == "default":
                out.append(f"# {assignment}")
            else:
                out.append(f"# source: {source}")
                out.append(assignment)
    return "\n".join(out) + "\n"


def diff_settings(old: Settings, new: Settings) -> list[tuple[str, Any, Any]]:
    """``(section.option, old value, new value)`` for every option that changed."""
    changes = []
    for section in SECTIONS:
        before, after = getattr(old, section.name), getattr(new, section.name)
        for opt in options(section):
            a, b = getattr(before, opt.name), getattr(after, opt.name)
            if a != b:
                changes.append((opt.key, a, b))
    return changes


def _metavar(opt: Option) -> str:
    if opt.help.startswith("HOST:PORT"):
        return "HOST:PORT"
    origin = typing.get_origin(opt.type)
    if origin in (tuple, list, frozenset, set):
        return "A,B,..."
    if origin in (dict, collections.abc.Mapping):
        return "K=V,..."
    if opt.type is int:
        return "N"
    if opt.type is float:
        return opt.unit.upper() if opt.unit in ("s", "ms") else "X"
    return opt.name.split("_")[-1].upper()


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, ``--print-config`` and one flag per coordinator option.

    Flags default to None (not given), so ``flag_overrides(args)`` passes on
    only what was typed and the file and environment keep the rest.
    """
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file ([coordinator], [scheduler], [advisor], [predictor], [memory_growth] tables)")
    parser.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    for section in SECTIONS:
        if not section.flags:
            continue
        for opt in options(section):
            unit = f" [{opt.unit}]" if opt.unit else ""
            default = _toml_value(opt.default) if opt.default is not None else "unset"
            bounds = f"range {opt.bounds.describe(verb=False)}; " if opt.bounds is not None else ""
            if opt.choices and opt.ignore_case:  # argparse does not list them (below)
                bounds += f"one of {', '.join(opt.choices)}; "
            text = f"{opt.help}{unit} ({bounds}default {default}; env {opt.env})".replace("%", "%%")
            kwargs: dict[str, Any] = {"dest": opt.name, "default": None, "help": text}
            if opt.type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["metavar"] = _metavar(opt)
                if opt.choices and not opt.ignore_case:  # those are checked (and named) by load_settings
                    kwargs["choices"] = opt.choices
            parser.add_argument(opt.flag, **kwargs)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags actually given, for ``load_settings``'s ``overrides``."""
    out = {}
    for section in SECTIONS:
        if section.flags:
            for opt in options(section):
                value = getattr(args, opt.name, None)
                if value is not None:
                    out[opt.name] = value
    return out


if __name__ == "__main__":
    # Regenerates the shipped reference file:
    #   python -m coordinator.settings > systemd/coordinator.toml
    print(render_settings(load_settings(None, {}, {}), commented_defaults=True), end="")
