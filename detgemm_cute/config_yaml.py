"""YAML with line numbers: the reader behind config validation (`registry`).

Every mapping it returns remembers its own line, each key's line and the keys written twice,
so a problem in a config file can name file:line and field."""

from __future__ import annotations

import yaml


class _Mapping(dict):
    """A YAML mapping that remembers its line, each key's line and repeated keys."""

    line = 0
    key_lines: dict = {}
    repeated: tuple = ()


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node):
    # A key written twice is an error, but a key that overrides one pulled in by a YAML
    # merge (`<<: *base`) is what merges are for: look for repeats among written keys only.
    written, repeated = set(), []
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        try:
            key = loader.construct_object(key_node, deep=True)
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark)
        if key in written:
            repeated.append((key, key_node.start_mark.line + 1))
        written.add(key)
    loader.flatten_mapping(node)
    out, lines = _Mapping(), {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        out[key] = loader.construct_object(value_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
    out.line, out.key_lines, out.repeated = node.start_mark.line + 1, lines, tuple(repeated)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text: str):
    """The document in `text`, mappings as `_Mapping` (yaml.YAMLError on malformed YAML)."""
    return yaml.load(text, Loader=_Loader)
