"""YAML for recipes and overrides, bounded: every bad file is one line naming the file (or override), the line
and the fix, never a traceback, a hang or a message of megabytes.

On top of ``yaml.SafeLoader`` (no Python tags) it refuses what a recipe never needs: nesting deeper than
:data:`MAX_DEPTH` (PyYAML's composer recurses: 10 000 levels are a ``RecursionError``), aliases expanding to
more than :data:`MAX_NODES` values (an "alias bomb": a few KB that expand to millions of values, and to a
message as large once printed), duplicate keys (YAML keeps the last one silently), integers of more than
:data:`MAX_INT_DIGITS` digits (Python refuses to parse > 4300 digits, in a message naming nothing) and text
that is not UTF-8.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import yaml

MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_INT_DIGITS = 64


class YamlLimitError(ValueError):
    """A YAML text breaks one of the bounds above (the message names the line)."""


def short(text: Any, limit: int = 60) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters (a value echoed in a message stays a line)."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _at(node_or_mark: Any) -> str:
    mark = getattr(node_or_mark, "start_mark", node_or_mark)
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YamlLimitError(f"nested more than {MAX_DEPTH} levels deep at {_at(self.peek_event())}; a recipe "
                                 "needs a few levels: check the brackets / indentation")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Any) -> Any:
        _check_expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):  # before `<<:` merges, whose keys are meant to be overridden
            seen: Dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (self.resolve(yaml.ScalarNode, key_node.value, (True, False))
                       if key_node.tag is None else key_node.tag, key_node.value)
                if key in seen:
                    raise YamlLimitError(f"duplicate key {short(key_node.value)} at {_at(key_node)} (first at line "
                                         f"{seen[key].line + 1}); keep one of them")
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise YamlLimitError(f"an integer of {digits} digits at {_at(node)}; no setting needs more than "
                                 f"{MAX_INT_DIGITS}")
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _check_expanded_size(root: Any) -> None:
    """The number of values the document has once its aliases are expanded (each node counted once per place
    it appears), without expanding them: sizes are memoized per node."""
    sizes: Dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_NODES:
                raise YamlLimitError(f"its aliases expand to more than {MAX_NODES} values (at {_at(node)}); a YAML "
                                     "alias bomb? write the values out, or use fewer nested aliases")
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def load_text(text: str) -> Any:
    """Parse ``text`` under the bounds (raises :class:`YamlLimitError` or ``yaml.YAMLError``)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_bytes(data: bytes, where: str, error: Callable[[str], Exception] = ValueError) -> Any:
    """``data`` (a file's bytes) parsed; any problem raised as ``error("<where>: <one line>")``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise error(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at line {line}); save the file as "
                    "UTF-8") from None
    try:
        return load_text(text)
    except YamlLimitError as e:
        raise error(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise error(f"{where}: not valid YAML: {' '.join(str(e).split())[:300]}") from None
    except RecursionError:  # a bound above missed a path: still one line
        raise error(f"{where}: nested too deeply to parse") from None
