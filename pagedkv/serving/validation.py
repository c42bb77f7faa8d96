"""The input boundary of the server: a request body becomes a plain JSON object here, or a
4xx OpenAI error, before any schema or handler sees it.

:func:`parse_json_body` bounds what the parser and everything after it can be made to do by
a body under the size limit:

* nesting: at most ``MAX_JSON_DEPTH`` arrays/objects deep, checked on the raw bytes before
  parsing (Python's JSON parser recurses per level: a 100 KB ``[[[[...`` would raise
  ``RecursionError``) -> 400 ``invalid_json``;
* integers: at most ``MAX_INT_DIGITS`` digits (every integer field is a 64-bit id, seed or
  count; a longer literal is kept unconverted, never passed to ``int()``, whose cost grows
  with the square of the digits and which refuses more than 4,300) -> 422 naming the field;
* numbers: finite (``1e999`` parses as inf) -> 422 naming the field; ``NaN`` and
  ``Infinity`` are not JSON -> 400 ``invalid_json``;
* strings, keys too: valid Unicode (a ``"\\ud800"`` escape decodes to a lone surrogate,
  which no tokenizer or UTF-8 encoder accepts) -> 400 ``invalid_unicode`` naming the field.

:func:`check_unsupported` turns an OpenAI parameter that pagedkv does not implement into a
400 naming it, instead of ignoring it (other unknown fields are ignored, as OpenAI's
clients may send extras).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Optional

import numpy as np

from pagedkv.serving.errors import APIError

MAX_JSON_DEPTH = 32  # nested arrays/objects; the deepest real body (chat content parts) is 5
MAX_INT_DIGITS = 20  # 2**64 has 20 digits: every id, seed and count fits

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)


class _BigInt:
    """An integer literal too long to convert (kept as its text)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_int(text: str) -> Any:
    return int(text) if len(text) - (text[0] == "-") <= MAX_INT_DIGITS else _BigInt(text)


def _no_constant(name: str) -> Any:
    raise APIError(400, f"malformed JSON body: {name} is not a JSON value", code="invalid_json")


def json_depth(raw: bytes) -> int:
    """How deeply arrays/objects nest in the JSON text ``raw`` (brackets inside strings do
    not count); linear time, no recursion. Exact for valid JSON, never an underestimate."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return raw.count(b"[") + raw.count(b"{")  # an upper bound that is already small
    a = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)
    step = np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def _path(where: tuple, key: Any = None) -> Optional[str]:
    parts = where if key is None else (*where, key)
    return ".".join(str(p) for p in parts) or None


def _valid_unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_value(v: Any, where: tuple, key: Any) -> Optional[APIError]:
    """The error for one scalar (None if it is fine); paths are built only for errors."""
    if type(v) is str:
        if _valid_unicode(v):
            return None
        return APIError(400, f"{_path(where, key) or 'body'}: the string is not valid Unicode "
                        "(a lone surrogate such as \\ud800)", param=_path(where, key), code="invalid_unicode")
    if type(v) is float and not math.isfinite(v):
        return APIError(422, f"{_path(where, key)}: number out of range (not a finite float)",
                        param=_path(where, key), code="invalid_value")
    if type(v) is _BigInt:
        return APIError(422, f"{_path(where, key)}: integer out of range ({len(v.text)} characters; "
                        f"at most {MAX_INT_DIGITS} digits)", param=_path(where, key), code="invalid_value")
    return None


def _check_values(data: dict[str, Any]) -> None:
    """Walk the parsed body (iteratively; ints, bools and None cost one type check) for big
    integers, non-finite numbers and invalid Unicode, keys included; raise the first as an
    APIError naming its field."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        node, where = stack.pop()
        is_dict = type(node) is dict
        for k, v in (node.items() if is_dict else enumerate(node)):
            if is_dict and not _valid_unicode(k):
                raise APIError(400, f"{_path(where) or 'body'}: a key is not valid Unicode", param=_path(where),
                               code="invalid_unicode")
            t = type(v)
            if t is dict or t is list:
                stack.append((v, (*where, k)))
            elif t is not int and t is not bool and v is not None:
                err = _bad_value(v, where, k)
                if err is not None:
                    raise err


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object within the limits above. Raises ``APIError``: 400
    ``invalid_json`` (not UTF-8, not JSON, not an object, too deep), 400 ``invalid_unicode``,
    422 ``invalid_value`` (an integer or number out of range)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"malformed JSON body: not UTF-8 ({e})", code="invalid_json") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"malformed JSON body: nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}",
                       code="invalid_json")
    # only a body with a run of more than MAX_INT_DIGITS digits (in a number or a string)
    # pays for a Python call per integer
    hook = _parse_int if _LONG_DIGITS.search(raw) else None
    try:
        data = json.loads(text, parse_int=hook, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:  # unreachable after the depth check; kept as the last guard
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    _check_values(data)
    return data


def _neutral(value: Any, allowed: Iterable[Any]) -> bool:
    return value is None or value is False or value in ("", [], {}) or value in list(allowed)


def check_unsupported(data: dict[str, Any], unsupported: dict[str, tuple]) -> None:
    """400 ``unsupported_parameter`` for the first field of ``unsupported`` (name -> values
    that mean "off") that ``data`` sets to anything else."""
    for name, allowed in unsupported.items():
        if name in data and not _neutral(data[name], allowed):
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")
