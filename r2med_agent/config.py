"""Registries (LLMs, encoders, tasks, reproduction grids) as YAML layers, read into frozen
dataclasses.

Layers, later wins per entry name: the package's ``configs/<name>.yaml``, then the user's config
file (``--config FILE``, else ``$R2MED_CONFIG``, else ``~/.config/r2med-agent/config.yaml`` when it
exists), whose top-level section of the same name (``llms:``, ``encoders:``) adds or replaces
entries without editing the package. Unknown keys are errors that name the file and the key; so
is a top-level section of the user file that names no registry (a typo such as ``llm:`` would
otherwise be ignored).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from r2med_agent.errors import ConfigError
from r2med_agent.names import name_problem
from r2med_agent.paths import configs_dir

T = TypeVar("T")

_user_config: Path | None = None


def set_user_config(path: str | os.PathLike[str] | None) -> None:
    """Point the registries at a user config file (the CLI's ``--config``)."""
    global _user_config
    _user_config = Path(path) if path else None
    load_yaml.cache_clear()


def user_config_path() -> Path | None:
    if _user_config is not None:
        return _user_config
    env = os.environ.get("R2MED_CONFIG")
    if env:
        return Path(env)
    default = Path.home() / ".config" / "r2med-agent" / "config.yaml"
    return default if default.exists() else None


MAX_YAML_ALIASES = 100
"""Most aliases (``*name``) one YAML file may use: a configuration needs a few, and every alias
can repeat a whole subtree, which is how an "alias bomb" of a few lines grows to gigabytes."""

MAX_YAML_NODES = 1_000_000
"""Most nodes a YAML file may hold once its aliases are expanded (each alias counted as the size
of the subtree it repeats)."""

MAX_YAML_ALIAS_TEXT = 10_000_000
"""Most characters of text (keys and values) a YAML file's aliases may add once expanded: one
10 kB string repeated through 50 nested aliases is 111,000 nodes (under :data:`MAX_YAML_NODES`)
but a gigabyte of text, which a run then copies and hashes (10 GB of memory in minutes)."""


class _YAMLLimit(yaml.YAMLError):
    """A YAML file beyond :data:`MAX_YAML_ALIASES`, :data:`MAX_YAML_NODES` or
    :data:`MAX_YAML_ALIAS_TEXT` (with its line)."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that counts aliases and the size of the document they expand to
    (nodes, and the characters of text their repeats add), and stops at the limits before
    anything is built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._expanded = 0
        self._alias_text = 0
        self._sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if not self.check_event(yaml.AliasEvent):
            self._count(1, 0, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        mark = self.peek_event().start_mark
        self._aliases += 1
        if self._aliases > MAX_YAML_ALIASES:
            raise _YAMLLimit(f"more than {MAX_YAML_ALIASES} aliases (*name); write the entries out", mark)
        node = super().compose_node(parent, index)
        self._count(*self._size(node), mark)
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        """PyYAML's, with a value its constructors cannot build (an integer of more digits than
        Python converts, a date such as 2001-02-30) an error at the value's line, not a
        ValueError traceback."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            value = node.value if isinstance(node.value, str) else ""
            why = (f"a number of {len(value):,} digits, more than Python converts ({sys.get_int_max_str_digits():,})"
                   if "digits" in str(e) else str(e))
            shown = repr(value if len(value) <= 40 else value[:40] + "...")
            raise yaml.constructor.ConstructorError(None, None, f"cannot read the value {shown}: {why}",
                                                    node.start_mark) from None

    def _count(self, nodes: int, text: int, mark: Any) -> None:
        self._expanded += nodes
        self._alias_text += text
        if self._expanded > MAX_YAML_NODES:
            raise _YAMLLimit(f"its aliases expand it beyond {MAX_YAML_NODES:,} nodes", mark)
        if self._alias_text > MAX_YAML_ALIAS_TEXT:
            raise _YAMLLimit(
                f"its aliases repeat more than {MAX_YAML_ALIAS_TEXT:,} characters of text; write "
                "the entries out", mark)

    def _size(self, node: Any) -> tuple[int, int]:
        """(nodes, characters of scalars) in ``node``'s subtree with every alias expanded
        (memoised per node)."""
        known = self._sizes.get(id(node))
        if known is not None:
            return known
        nodes, text = 1, 0
        if isinstance(node, yaml.ScalarNode):
            text = len(node.value)
        else:
            children = (node.value if isinstance(node, yaml.SequenceNode)
                        else [c for pair in node.value for c in pair])
            for child in children:
                n, t = self._size(child)
                nodes, text = nodes + n, text + t
        self._sizes[id(node)] = (nodes, text)
        return nodes, text



# YAML's own timestamps, whatever another library registered on SafeLoader (a test run that
# imported such a library read '2001-02-30' as a string and never said which line was wrong).
_BoundedLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.constructor.SafeConstructor.construct_yaml_timestamp)

def read_yaml(path: Path) -> Any:
    """Parse a YAML file; unreadable, non-UTF-8 or malformed files raise ConfigError with file:line.

    Only plain data is built (PyYAML's safe loader), and a file whose aliases repeat more than
    :data:`MAX_YAML_ALIASES` times, expand it beyond :data:`MAX_YAML_NODES` nodes or repeat more
    than :data:`MAX_YAML_ALIAS_TEXT` characters of text is refused before it is built."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({e.reason}); save it as UTF-8") from None
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except _YAMLLimit as e:
        raise ConfigError(f"{path}:{e.problem_mark.line + 1}: refused YAML: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: malformed YAML: {getattr(e, 'problem', e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None
    finally:
        loader.dispose()


class _Cache:
    """Parsed YAML per (path, modification time, size): an edited file is read again."""

    def __init__(self) -> None:
        self._d: dict[tuple[Path, int, int], Any] = {}

    def __call__(self, path: Path) -> Any:
        path = Path(path)
        try:
            st = path.stat()
            key = (path, st.st_mtime_ns, st.st_size)
        except OSError:
            return read_yaml(path)  # raises the readable error
        if key not in self._d:
            self._d[key] = read_yaml(path)
        return self._d[key]

    def cache_clear(self) -> None:
        self._d.clear()
        _registry_cache.clear()


load_yaml = _Cache()
_registry_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
_hints_cache: dict[type, dict[str, Any]] = {}


def _file_state(path: Path | None) -> tuple[Any, ...]:
    if path is None:
        return (None,)
    try:
        st = path.stat()
        return (path, st.st_mtime_ns, st.st_size)
    except OSError:
        return (path, None, None)


def user_sections() -> tuple[str, ...]:
    """The top-level sections a user config may have: one per registry file of the package
    (``encoders``, ``llms``, ``rerankers``, ``tasks``)."""
    return tuple(sorted(p.stem for p in configs_dir().glob("*.yaml")))


def _key_line(path: Path, *keys: str) -> int | None:
    """1-based line of the key reached by ``keys`` (``"llms", "mine"``: the entry ``mine`` of the
    top-level section ``llms``) in the YAML file ``path`` (None when not found)."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            return None
        found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key]
        if not found:
            return None
        line, node = found[0][0].start_mark.line + 1, found[0][1]
    return line


def check_entry_name(section: str, name: str, where: str) -> None:
    """Refuse an entry name that cannot be a folder or file name (:func:`names.name_problem`):
    ``where`` is the file and line that gives it."""
    from r2med_agent.names import NAME_RULE

    problem = name_problem(name)
    if problem is not None:
        raise ConfigError(f"{where}: {section}.{name!r} cannot name an entry ({problem}); names become folder "
                          f"names, so use {NAME_RULE}")


def _check_user_sections(path: Path, doc: Mapping[str, Any]) -> None:
    known = user_sections()
    unknown = [str(k) for k in doc if str(k) not in known]
    if unknown:
        line = _key_line(path, unknown[0])
        where = f"{path}:{line}" if line is not None else str(path)
        raise ConfigError(
            f"{where}: unknown top-level section(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed: {', '.join(known)}"
        )


_PYTHON_ENTRIES: dict[str, dict[str, dict[str, Any]]] = {}
"""Entries registered from Python (:func:`register_entry`): section -> name -> fields."""
_PYTHON_SOURCE = Path("<registered from Python>")
PYTHON_SOURCE = _PYTHON_SOURCE
"""Where an entry registered from Python says it came from."""


def register_entry(section: str, name: str, fields: Mapping[str, Any]) -> None:
    """Add or replace one registry entry for this process, above the package and user layers
    (the Python API registers a user's own LLM this way)."""
    check_entry_name(section, name, str(_PYTHON_SOURCE))
    _PYTHON_ENTRIES.setdefault(section, {})[name] = dict(fields)
    _registry_cache.clear()


def registry_entries(section: str) -> dict[str, tuple[dict[str, Any], Path]]:
    """All raw entries of a registry section, package layer first, then the user file.

    Returns ``{name: (fields, file it came from)}``.
    """
    out: dict[str, tuple[dict[str, Any], Path]] = {}
    layers = [configs_dir() / f"{section}.yaml"]
    user = user_config_path()
    for i, path in enumerate([*layers, user] if user else layers):
        if not path.exists():
            if i == len(layers) and user is not None:
                raise ConfigError(f"{path}: user config file does not exist")
            continue
        doc = load_yaml(path) or {}
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        if path == user:
            _check_user_sections(path, doc)
        entries = doc.get(section, {}) if path == user else doc
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            raise ConfigError(f"{path}: section '{section}' must be a mapping of name -> fields")
        for name, fields in entries.items():
            if name_problem(str(name)) is not None:
                keys = (section, str(name)) if path == user else (str(name),)
                line = _key_line(path, *keys)
                check_entry_name(section, str(name), f"{path}:{line}" if line is not None else str(path))
            if not isinstance(fields, Mapping):
                raise ConfigError(f"{path}: entry '{section}.{name}' must be a mapping")
            out[str(name)] = (dict(fields), path)
    for name, fields in _PYTHON_ENTRIES.get(section, {}).items():
        out[name] = (dict(fields), _PYTHON_SOURCE)
    return out


def build(cls: type[T], fields: Mapping[str, Any], where: str) -> T:
    """Build frozen dataclass ``cls`` from YAML ``fields``; unknown keys and bad types are errors.

    Nested dataclass fields are built recursively; lists become tuples.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )
    hints = _hints_cache.get(cls)
    if hints is None:
        hints = _hints_cache[cls] = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in fields.items():
        kwargs[key] = _coerce(hints[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        return build(tp, value, where)
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict,):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def load_registry(section: str, cls: type[T]) -> dict[str, T]:
    """Read a whole registry section into ``{name: cls(...)}`` (every entry validated).

    ``cls`` must have a ``name`` field; it is filled from the entry's key.
    """
    pkg = configs_dir() / f"{section}.yaml"
    key = (section, cls, _file_state(pkg), _file_state(user_config_path()))
    cached = _registry_cache.get(key)
    if cached is not None:
        return dict(cached)
    out: dict[str, T] = {}
    for name, (fields, path) in registry_entries(section).items():
        out[name] = build(cls, {"name": name, **fields}, f"{path}: {section}.{name}")
    _registry_cache[key] = out
    return dict(out)


def lookup(section: str, cls: type[T], name: str) -> T:
    """One registry entry by name; an unknown name lists the known ones."""
    from r2med_agent.errors import did_you_mean

    reg = load_registry(section, cls)
    if name not in reg:
        raise ConfigError(
            f"unknown {section[:-1] if section.endswith('s') else section} '{name}'"
            f"{did_you_mean(name, reg)}; known: "
            f"{', '.join(sorted(reg))} (add your own under '{section}:' in a user config file)"
        )
    return reg[name]
