"""YAML the user hands in (sweep specs, cluster site files, the value of a key=value on a command line):
PyYAML's safe loader without aliases, and its errors in one line.

    read("sweeps/x.yaml", "sweep spec")   # the parsed file; UserError naming the file otherwise
    loads("[1, 2]")                       # [1, 2]; UserError when it is not valid YAML or holds an alias

An alias (``*name``) re-uses the node its anchor (``&name``) marks without copying it, so nine nested
lists of nine aliases each hold 9**9 values in a few hundred bytes (a "billion laughs"), and whatever
walks or prints the loaded value then runs for minutes. Aliases are therefore refused, all of them: the
first one ends the load, naming its line, before any value is built. An anchor alone is harmless, and so
is a merge key with an inline mapping (``<<: {...}``); ``<<: *name`` is an alias and is refused too.

Lists and mappings nested deeper than ``MAX_DEPTH`` are refused the same way, at the first one too deep: PyYAML's
composer, and Hydra, OmegaConf and pydantic after it, recurse once or more per level, so a few kilobytes of
brackets would otherwise end in Python's RecursionError. ``experiments.build.compose`` holds a ``key=value``
override to the same bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from experiments.errors import UserError, undecodable

# The deepest nesting of lists and mappings user input may have (a YAML file or value, a key=value override with
# its dotted key's levels counted): far above what a config needs, far below where a parser's recursion ends.
MAX_DEPTH = 32


def too_deep() -> str:
    return f"nested too deep (lists and mappings within each other); the maximum depth is {MAX_DEPTH}"


class Refused(yaml.MarkedYAMLError):
    """YAML refused before it is built: an alias, or nesting deeper than MAX_DEPTH (see the module docstring)."""


class NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses the first alias, and the first list or mapping nested deeper than MAX_DEPTH,
    before it is composed into the document."""

    depth = 0  # the lists and mappings the node being composed is inside

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise Refused(
                problem=f"YAML alias *{event.anchor}: aliases are not allowed; write the value out",
                problem_mark=event.start_mark,
            )
        if not self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        if self.depth >= MAX_DEPTH:
            raise Refused(problem=too_deep(), problem_mark=self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def one_line(exc: yaml.YAMLError) -> str:
    """A PyYAML error in one line: 'line 2, column 5: <problem> (<context>)'."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return f"{where}{exc.problem}" + (f" ({exc.context})" if exc.context else "")
    if isinstance(exc, yaml.reader.ReaderError):
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        return f"unacceptable character #x{code:04x} at offset {exc.position}: {exc.reason}"
    return " ".join(str(exc).split())


def loads(text: str, loader: type[yaml.SafeLoader] = NoAliasLoader) -> Any:
    """`text` parsed by `loader`; UserError (one line) when it is not valid YAML, holds an alias or is nested
    deeper than MAX_DEPTH."""
    try:
        return yaml.load(text, Loader=loader)
    except Refused as e:
        raise UserError(one_line(e)) from None
    except yaml.YAMLError as e:
        raise UserError(f"not valid YAML: {one_line(e)}") from None


def read(path: str | Path, what: str, loader: type[yaml.SafeLoader] = NoAliasLoader) -> Any:
    """The YAML file at `path` (a `what`, e.g. "sweep spec") parsed by `loader`; UserError naming the file
    when it is missing, a directory, not UTF-8 text, not valid YAML, holds an alias or is nested too deep."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{path}: is a directory, not a {what}")
    if not p.is_file():
        raise UserError(f"{path}: no such {what}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: {undecodable(e)}; a {what} is YAML text") from None
    try:
        return loads(text, loader)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
