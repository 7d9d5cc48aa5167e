"""Stand-in for the ``hjson`` package, installed as ``hjson`` for the vendored tests only when the
real package is not importable (tachyon does not depend on it). It provides what those tests
call, ``dump`` / ``dumps``, writing Hjson the way the package does by default (no quotes around
keys and plain strings, one member per line, no commas), so a test that writes its config with
``hjson.dump`` hands tachyon a real Hjson file. Once it is ``hjson``, tachyon's config loader
takes it for the package and calls ``loads(text, object_pairs_hook=...)``: that reads with
tachyon's own Hjson reader (`tachyon.config.hjson`), then passes each object's pairs to the hook.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import IO, Any

from tachyon.config import hjson as _reader

_PLAIN_KEY = re.compile(r"[^\s{}\[\],:#\"'/]+")
_NEEDS_QUOTES = re.compile(r"^\s|\s$|^[{}\[\],:\"']|#|//|/\*|\n")


def _string(value: str) -> str:
    if not value or _NEEDS_QUOTES.search(value):
        return json.dumps(value)
    try:  # a string that would read back as a number / true / false / null keeps its quotes
        json.loads(value)
    except json.JSONDecodeError:
        return value
    return json.dumps(value)


def _emit(value: Any, indent: str, lines: list[str], prefix: str) -> None:
    inner = indent + "  "
    if isinstance(value, dict):
        if prefix:  # a nested object opens on its own line, as hjson writes it
            lines.append(prefix.rstrip())
        lines.append(indent + "{")
        for key, item in value.items():
            key = str(key)
            name = key if _PLAIN_KEY.fullmatch(key) else json.dumps(key)
            _emit(item, inner, lines, f"{inner}{name}: ")
        lines.append(indent + "}")
    elif isinstance(value, (list, tuple)):
        if prefix:
            lines.append(prefix.rstrip())
        lines.append(indent + "[")
        for item in value:
            _emit(item, inner, lines, "")
        lines.append(indent + "]")
    else:
        text = _string(value) if isinstance(value, str) else json.dumps(value)
        lines.append((prefix or indent) + text)


def dumps(obj: Any, **kwargs: Any) -> str:
    """``obj`` as Hjson text (``kwargs``, the package's formatting options, are not supported)."""
    if kwargs:
        raise NotImplementedError(f"the hjson stand-in takes no formatting options (got {sorted(kwargs)})")
    lines: list[str] = []
    _emit(obj, "", lines, "")
    return "\n".join(lines)


def dump(obj: Any, fp: IO[str], **kwargs: Any) -> None:
    fp.write(dumps(obj, **kwargs))


def _pairs_to_hook(value: Any, hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:
    if isinstance(value, dict):
        return hook([(key, _pairs_to_hook(item, hook)) for key, item in value.items()])
    if isinstance(value, list):
        return [_pairs_to_hook(item, hook) for item in value]
    return value


def loads(text: str, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
          **kwargs: Any) -> Any:
    """``text`` read by tachyon's Hjson reader (which refuses duplicate keys itself); each object's
    pairs go through ``object_pairs_hook`` as the package does."""
    if kwargs:
        raise NotImplementedError(f"the hjson stand-in's loads takes only object_pairs_hook (got {sorted(kwargs)})")
    value = _reader.loads(text)
    return value if object_pairs_hook is None else _pairs_to_hook(value, object_pairs_hook)
