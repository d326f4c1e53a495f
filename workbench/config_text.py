"""Reading a config file's text strictly: what a file says is data, read once, never trusted.

:func:`read_config_file` reads a JSON or YAML file (by suffix: ``.yaml`` / ``.yml`` are YAML,
anything else JSON) and refuses, before any value reaches a config:

- a file over :data:`MAX_FILE_BYTES`, a directory, an unreadable file, text that is not UTF-8;
- a file with no document (empty, or only comments / whitespace);
- a key given twice in one mapping (JSON and YAML would silently keep the last);
- YAML anchors and aliases that expand to more than :data:`MAX_VALUES` values (a few hundred
  bytes of nested aliases expand to gigabytes), and recursive aliases.  The check runs on the
  composed node graph, where an alias is one shared node, so nothing is expanded to count it.

Errors are :class:`ConfigTextError` (a ``ValueError``) with the rule and the fix; the caller names
the file.  Plain data only: YAML is read with PyYAML's safe loader (no Python objects).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ConfigTextError", "MAX_FILE_BYTES", "MAX_VALUES", "parse_json", "parse_yaml", "read_config_file"]

#: a run config is a few KB; this bounds what reading one can cost
MAX_FILE_BYTES = 1 << 20
#: values (scalars, lists and mappings) one config may hold once aliases are expanded: a full run
#: config has about 150, custom-hook keyword arguments included this leaves ample room
MAX_VALUES = 10_000


class ConfigTextError(ValueError):
    """A config file's text that cannot be read as a config: ``rule`` says why, ``fix`` what to do."""

    def __init__(self, rule: str, fix: str):
        self.rule, self.fix = rule, fix
        super().__init__(f"{rule} -> {fix}")


# --------------------------------------------------------------------------- JSON


class _Pairs(list):
    """One JSON object's (key, value) pairs in file order, duplicates kept (turned into a dict later)."""


def _json_to_data(obj: Any, path: str) -> Any:
    if isinstance(obj, _Pairs):
        out: dict[str, Any] = {}
        for key, value in obj:
            where = f"{path}.{key}" if path else key
            if key in out:
                raise ConfigTextError(f"duplicate key '{where}': JSON would silently keep only the last value",
                                      f"remove one of the two '{key}' entries")
            out[key] = _json_to_data(value, where)
        return out
    if isinstance(obj, list):
        return [_json_to_data(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


def parse_json(text: str) -> Any:
    """JSON text as plain data; a duplicate key is a :class:`ConfigTextError` naming its path."""
    try:
        obj = json.loads(text, object_pairs_hook=_Pairs)
    except RecursionError:
        raise ConfigTextError("nested too deeply to be a config", "a run config has two levels of sections") from None
    except ValueError as e:  # json.JSONDecodeError, and integers of more digits than Python converts
        raise ConfigTextError(f"not valid JSON: {e}", "fix the syntax") from None
    return _json_to_data(obj, "")


# --------------------------------------------------------------------------- YAML


def _loader_class() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """PyYAML's safe loader that refuses a key given twice in one mapping (merge keys ``<<`` excepted)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: the safe loader reports it
                    continue
                if first is not None:
                    raise ConfigTextError(
                        f"duplicate key '{key}' at line {key_node.start_mark.line + 1} (first at line {first.line + 1}): "
                        "YAML would silently keep only the last value", f"remove one of the two '{key}' entries")
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _expanded_values(root: Any) -> int:
    """Values the node graph holds once every alias is expanded, counted on the shared nodes; a
    :class:`ConfigTextError` past :data:`MAX_VALUES` or for an alias inside its own anchor."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigTextError(f"a recursive YAML alias at line {node.start_mark.line + 1} (an anchor used inside itself)",
                                  "write the value out; a config holds plain data")
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v) for v in node.value)
        else:
            n = 1
        open_nodes.discard(key)
        if n > MAX_VALUES:
            raise ConfigTextError(f"its YAML aliases expand to more than {MAX_VALUES} values (a run config holds a few hundred)",
                                  "write the values out without anchors (&name) and aliases (*name)")
        sizes[key] = n
        return n

    return size(root)


def parse_yaml(text: str) -> Any:
    """YAML text as plain data (``None`` for no document); duplicate keys and alias expansion past
    :data:`MAX_VALUES` are :class:`ConfigTextError`, other syntax errors ``yaml.YAMLError``."""
    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_values(node)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigTextError("nested too deeply to be a config", "a run config has two levels of sections") from None
    except ConfigTextError:
        raise
    except ValueError as e:  # a scalar the safe loader cannot convert (an integer of more digits than Python reads)
        raise ConfigTextError(f"not valid YAML: {e}", "fix the value") from None
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- files


def read_config_file(path: str | Path) -> Any:
    """The plain data of a JSON or YAML config file; every way the file itself is wrong is a
    :class:`ConfigTextError` (the caller names the file)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise ConfigTextError("file not found", "check the path")
    if not path.is_file():
        raise ConfigTextError("is not a file", "pass a .yaml, .yml or .json config file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigTextError(f"is {size} bytes; a run config is a few KB (at most {MAX_FILE_BYTES} bytes are read)",
                                  "pass the run config file, not a data or checkpoint file")
        raw = path.read_bytes()[: MAX_FILE_BYTES + 1]
    except OSError as e:
        raise ConfigTextError(f"cannot be read: {e.strerror or e}", "check the file's permissions") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the text
    except UnicodeDecodeError as e:
        raise ConfigTextError(f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
                              "save the config as UTF-8 text (a .yaml or .json file)") from None
    try:
        data = None if not text.strip() else parse_yaml(text) if path.suffix.lower() in (".yaml", ".yml") else parse_json(text)
    except yaml.YAMLError as e:
        raise ConfigTextError(f"not valid YAML: {e}", "fix the syntax") from None
    if data is None:
        raise ConfigTextError("holds no config (the file is empty, or only comments)",
                              "write the config into it, e.g. `workbench config preset tiny --yaml > FILE`")
    return data
