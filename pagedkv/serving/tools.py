"""Tool calling for ``/v1/chat/completions``: ``tools`` and ``tool_choice``.

In: the tools are described to the model in a system message (the bundled models' chat
templates do not render tools; the message is put before the conversation, or merged into
its own system message), unless ``tool_choice`` is ``"none"``. Earlier turns' tool calls
and tool results are rendered as text (``chat_message_text``).

The model calls a function by answering ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one block per call). ``tool_choice``:

* ``"auto"`` (the default with tools): unconstrained; the answer's blocks that hold a JSON
  object naming a declared tool become ``message.tool_calls``, the rest stays ``content``.
* ``"required"``: the output is constrained by a JSON schema built from the tools: an
  array of ``{"name": <one of the tools>, "arguments": <its parameters schema>}`` (one item
  with ``parallel_tool_calls: false``).
* a named function ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by that function's parameters schema; it is that call's arguments.
* ``"none"``: no tools shown, nothing parsed.

Out: a choice with calls has ``message.content`` (text outside the blocks, or null),
``message.tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments":
JSON text}}]``) and ``finish_reason`` ``"tool_calls"``. A stream of a call with tools
(not ``"none"``) sends a choice's text when it finishes: its tool calls as one
``delta.tool_calls`` chunk, or its content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedkv.engine.structured import StructuredSpec
from pagedkv.serving.errors import APIError

CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def tools_prompt(tools: list[Any]) -> str:
    """The system text that describes ``tools`` (``ToolDef`` models) and the call format."""
    sigs = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                 "parameters": t.function.parameters or ANY_OBJECT}) for t in tools)
    return ("You can call functions. Their signatures (JSON Schema) are inside <tools></tools>:\n"
            f"<tools>\n{sigs}\n</tools>\n"
            "To call a function, answer with a <tool_call></tool_call> block per call, each holding "
            "a JSON object with the function's name and its arguments:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')


def chat_message_text(m: Any) -> str:
    """A message's text for the chat template: an assistant's earlier ``tool_calls`` are
    written as the ``<tool_call>`` blocks it answered with."""
    text = m.text()
    for call in m.tool_calls or ():
        fn = call.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        text += ("\n" if text else "") + "<tool_call>\n" + json.dumps(
            {"name": fn.get("name", ""), "arguments": args}) + "\n</tool_call>"
    return text


@dataclass
class ToolCalls:
    """The tool calling of one chat call. ``mode``: "auto", "required" or "named";
    ``names``: the declared functions; ``named``: the forced function (mode "named")."""

    mode: str
    names: list[str]
    tools: list[Any] = field(repr=False)
    named: Optional[str] = None
    parallel: bool = True
    _buffers: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, body: Any) -> Optional["ToolCalls"]:
        """The body's tool calling, or None (no tools, or ``tool_choice`` "none"). Raises
        400 for a ``tool_choice`` that needs tools or names an undeclared function."""
        choice = body.tool_choice
        tools = body.tools or []
        if choice == "none":
            return None
        if not tools:
            if choice is not None and choice != "auto":
                raise _bad("tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise _bad("tools: function names must be unique", "tools")
        named = None
        if choice is not None and not isinstance(choice, str):
            named = choice.function.name
            if named not in names:
                raise _bad(f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")
        mode = "named" if named else (choice or "auto")
        return cls(mode, names, list(tools), named, body.parallel_tool_calls is not False)

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the tools described in their system message."""
        text = tools_prompt(self.tools)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _params(self, name: str) -> dict[str, Any]:
        fn = next(t.function for t in self.tools if t.function.name == name)
        return fn.parameters or ANY_OBJECT

    def constraint(self) -> Optional[StructuredSpec]:
        """The JSON schema of ``required`` / named calls (None for ``auto``)."""
        if self.mode == "named":
            return StructuredSpec("json_schema", self._params(self.named))
        if self.mode != "required":
            return None
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": self._params(n)},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for n in self.names]}
        schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredSpec("json_schema", schema)

    def parse(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """``(content, tool calls)`` of a finished answer (no calls: ``(text, [])``)."""
        found: list[tuple[str, Any]] = []
        content = text
        try:
            if self.mode == "named":
                found = [(self.named, json.loads(text))]
                content = ""
            elif self.mode == "required":
                found = [(c["name"], c["arguments"]) for c in json.loads(text)]
                content = ""
        except (ValueError, TypeError, KeyError):
            return text, []
        if self.mode == "auto":
            kept = []
            for m in CALL_RE.finditer(text):
                try:
                    obj = json.loads(m.group(1))
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("name") in self.names:
                    found.append((obj["name"], obj.get("arguments", {})))
                    kept.append(m.group(0))
            for block in kept:
                content = content.replace(block, "", 1)
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": n, "arguments": json.dumps(a)}} for n, a in found]
        return (content.strip() or None) if calls else text, calls

    def message(self, text: str, finish: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The chat ``message`` and finish reason of a finished answer."""
        content, calls = self.parse(text) if finish == "stop" else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def stream_choice(self, idx: int, delta: str, finish: Optional[str]) -> Optional[dict[str, Any]]:
        """A streamed choice: None while the answer is unfinished (its text is kept), then
        its content or its tool calls (``delta.tool_calls`` with an ``index`` each)."""
        text = self._buffers.get(idx, "") + delta
        if finish is None:
            self._buffers[idx] = text
            return None
        self._buffers.pop(idx, None)
        msg, reason = self.message(text, finish)
        if "tool_calls" in msg:
            d: dict[str, Any] = {"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]}
            if msg["content"]:
                d["content"] = msg["content"]
        else:
            d = {"content": text} if text else {}
        return {"index": idx, "delta": d, "logprobs": None, "finish_reason": reason}
