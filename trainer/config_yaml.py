"""Config text as the user wrote it: YAML files and `KEY VALUE` override values.

A key twice in one mapping (a second `SOLVER:` section) and YAML aliases (which can expand into
something large) are errors. Numbers remember their text, so that a string-typed key keeps what was
written (`TRACKING.EXPERIMENT 12:30` is not 750, as YAML 1.1 reads it, nor `RUN_NAME 010` 8);
dates stay text. Detectron writes tuples as Python literals (`(800,)`), read here too.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from trainer.errors import ConfigError


class _Loader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(f"YAML aliases are not allowed in a config (line {mark.line + 1})")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise ConfigError(f"duplicate key {key} (line {key_node.start_mark.line + 1})")
                seen.add(key)
            except TypeError:  # an unhashable key: YAML's own constructor says so below
                break
        return super().construct_mapping(node, deep)


class Int(int):
    source = ""


class Float(float):
    source = ""


class Bool(str):
    """A YAML 1.1 boolean (`true`, `yes`, `off`...) as written: a bool key takes its truth, a string key
    its text (`RUN_NAME: yes` is 'yes', as the override `TRACKING.RUN_NAME yes` is)."""
    truth = False


def _bool(loader, node):
    value = Bool(node.value)
    value.truth = yaml.SafeLoader.construct_yaml_bool(loader, node)
    return value


def _with_source(kind, construct):
    def constructor(loader, node):
        try:
            value = kind(construct(loader, node))
        except ValueError:  # Python reads at most 4,300 digits (int()); no key takes anything near
            raise ConfigError(f"a {len(node.value):,}-digit number is out of range for any config key") from None
        value.source = node.value
        return value
    return constructor


_Loader.add_constructor("tag:yaml.org,2002:int", _with_source(Int, yaml.SafeLoader.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float", _with_source(Float, yaml.SafeLoader.construct_yaml_float))
_Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)
_Loader.add_constructor("tag:yaml.org,2002:bool", _bool)


def load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader


def plain(value):
    """Loaded data with plain int and float again (the config is dumped, hashed and saved)."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Bool):
        return value.truth
    if isinstance(value, Int):
        return int(value)
    if isinstance(value, Float):
        return float(value)
    return value


def literal(text: str):
    """Detectron writes tuples as Python literals: `(800,)`, `('a', 'b')`."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # TypeError: `{[1]: 2}`
        return text


_COMMENT = re.compile(r"(^|\s)#")


def parse_override(text: str, as_text: bool = False, key: str = "a value"):
    """An override's value. For a string key (as_text) it is the word as typed: a path holding
    ` #`, `*` or `: ` stays itself; only a quoted or bracketed word is read, and `null` is empty."""
    text = text.strip()
    if as_text:
        if text[:1] in "'\"([{":  # quoted, or a list given for a string (a mistake said as such)
            return parse_override(text, key=key)
        return "" if text in ("null", "~") else text
    if text[:1] in "([{":
        value = literal(text)
        if not isinstance(value, str):
            return value
    try:
        value = load_yaml(text) if text else ""
    except yaml.YAMLError:
        return text
    except ConfigError as e:  # a number of thousands of digits, an alias
        raise ConfigError(f"{key}: {e}") from None
    if _COMMENT.search(text) and text[:1] not in "'\"":  # YAML would drop the rest without a word
        raise ConfigError(f"{key} {text!r}: ' #' starts a YAML comment, which would cut the value; quote it")
    return value


MAX_CONFIG_BYTES = 1 << 20  # Detectron's longest config is 2 kB; a dataset catalog inline, some more


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():  # a folder, a FIFO, a device: reading it would fail or never end
        raise ConfigError(f"config file {path} is not a regular file")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:  # YAML's parser took a minute and 860 MB for 50 MB
        raise ConfigError(f"config file {path} is {size / 2**20:.1f} MiB: a config is a few kB (at most "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB), is it the right file?")
    try:
        data = load_yaml(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:  # unreadable, or not text at all (a .pth passed by mistake)
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"malformed YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    except ConfigError as e:  # a duplicate key, an alias
        raise ConfigError(f"{path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(plain(data)).__name__}")
    return data
