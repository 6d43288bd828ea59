"""Reading a YAML file a person wrote: a key given twice in one mapping is refused (YAML would keep
the last silently), and malformed YAML is named by file, line and column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.errors import InvalidInput


class DuplicateKey(yaml.MarkedYAMLError):
    """A mapping names the same key twice: YAML keeps the last silently, so a setting
    written twice would lose one of its values without a word."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class says so
                break
            if earlier is not key_node.start_mark:
                raise DuplicateKey(
                    problem=f"key '{key}' is given twice in one mapping, at {_place(earlier)} and "
                    f"{_place(key_node.start_mark)}; YAML would keep only the last. Keep the one you mean",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _place(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def read(path: Path) -> Any:
    """The file's YAML document; InvalidInput naming the file and the place of a problem."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except DuplicateKey as err:
        raise InvalidInput(f"{path}: {err.problem}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = _place(mark) if mark else "somewhere"
        raise InvalidInput(f"{path}: malformed YAML at {where}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise InvalidInput(f"{path}: malformed YAML: {err}") from None
