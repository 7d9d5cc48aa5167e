"""Reading DeepSpeed config files the way DeepSpeed does: as Hjson, the JSON superset it parses
config files with (``hjson.load``), without depending on the hjson package.

Hjson adds to JSON what people write in hand-edited configs, and this reader takes all of it:

- comments: ``# ...``, ``// ...`` and ``/* ... */``;
- commas: optional between members and elements written on separate lines, and a trailing comma
  is allowed;
- keys without quotes (``lr: 0.001``); strings in single quotes; ``'''`` multi-line strings;
- quoteless string values, which run to the end of the line (``type: Adam``); a line holding
  only a number, ``true``, ``false`` or ``null`` is that value, as in Hjson;
- the braces around the root object may be left out.

Plain JSON reads exactly as with ``json.loads``. A key given twice is an error (DeepSpeed refuses
duplicate keys too).
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_PUNCT = set("{}[],:")


class HjsonError(ValueError):
    """A syntax error, with its 1-based line and column."""

    def __init__(self, message: str, text: str, pos: int):
        self.lineno = text.count("\n", 0, pos) + 1
        self.colno = pos - (text.rfind("\n", 0, pos) + 1) + 1
        super().__init__(f"{self.lineno}:{self.colno}: {message}")
        self.msg = message


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, message: str) -> HjsonError:
        return HjsonError(message, self.text, self.pos)

    def skip(self) -> None:
        """Whitespace and comments."""
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in " \t\r\n\ufeff":
                self.pos += 1
            elif char == "#" or text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.fail("unterminated /* comment")
                self.pos = end + 2
            else:
                return

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def document(self) -> Any:
        first = self.peek()
        if first not in ("{", "["):  # Hjson's root object without braces
            value = self.members(end="")
        else:
            value = self.value()
        if self.peek():
            raise self.fail("unexpected text after the end of the config")
        return value

    def members(self, end: str) -> dict:
        out: dict[str, Any] = {}
        while True:
            char = self.peek()
            if char == end:
                self.pos += len(end)
                return out
            if not char:
                raise self.fail("unexpected end of the config: a '}' is missing")
            key_pos = self.pos
            key = self.key()
            if self.peek() != ":":
                raise self.fail(f"expected ':' after the key {key!r}")
            self.pos += 1
            if key in out:
                self.pos = key_pos
                raise self.fail(f"duplicate key {key!r}")
            out[key] = self.value()
            if self.peek() == ",":
                self.pos += 1

    def elements(self) -> list:
        out = []
        while True:
            char = self.peek()
            if char == "]":
                self.pos += 1
                return out
            if not char:
                raise self.fail("unexpected end of the config: a ']' is missing")
            out.append(self.value())
            if self.peek() == ",":
                self.pos += 1

    def key(self) -> str:
        char = self.peek()
        if char in ("'", '"'):
            return self.quoted(char)
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _PUNCT and not self.text[self.pos].isspace():
            self.pos += 1
        if self.pos == start:
            raise self.fail(f"expected a key; got {char!r}")
        return self.text[start:self.pos]

    def quoted(self, quote: str) -> str:
        text = self.text
        if text.startswith("'''", self.pos):
            end = text.find("'''", self.pos + 3)
            if end < 0:
                raise self.fail("unterminated ''' string")
            value, self.pos = text[self.pos + 3:end], end + 3
            return value.strip("\n")
        start, self.pos = self.pos, self.pos + 1
        while self.pos < len(text) and text[self.pos] != quote:
            if text[self.pos] == "\n":
                break
            self.pos += 2 if text[self.pos] == "\\" else 1
        if self.pos >= len(text) or text[self.pos] != quote:
            self.pos = start
            raise self.fail("unterminated string")
        self.pos += 1
        body = text[start + 1:self.pos - 1]
        if quote == "'":
            body = body.replace('\\"', '"').replace('"', '\\"').replace("\\'", "'")
        try:
            return json.loads(f'"{body}"')
        except json.JSONDecodeError as error:
            self.pos = start
            raise self.fail(f"bad string: {error.msg}") from None

    def value(self) -> Any:
        char = self.peek()
        if char == "{":
            self.pos += 1
            return self.members(end="}")
        if char == "[":
            self.pos += 1
            return self.elements()
        if char in ("'", '"'):
            return self.quoted(char)
        if not char or char in _PUNCT:
            raise self.fail(f"expected a value; got {char or 'the end of the config'!r}")
        return self.bare()

    def bare(self) -> Any:
        """A number / true / false / null, or a quoteless string running to the end of the line."""
        text, start = self.text, self.pos
        end = text.find("\n", start)
        line = text[start:] if end < 0 else text[start:end]
        literal = re.match(r"(true|false|null|" + _NUMBER.pattern + r")\s*(?=$|[,\]}]|#|//|/\*)", line)
        if literal:
            self.pos = start + len(literal.group(1))
            return json.loads(literal.group(1))
        self.pos = start + len(line)
        return line.rstrip()


def loads(text: str) -> Any:
    """Parse Hjson (or JSON) text; raises `HjsonError` with the line and column."""
    return _Parser(text).document()


__all__ = ["HjsonError", "loads"]
