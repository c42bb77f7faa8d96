"""The HTTP protocol of the server: uvicorn's h11 protocol, with a header and a body
deadline that cut slow and idle clients, and its protocol errors as OpenAI error objects.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but bounds neither how long a client may take to send its request
head nor its body: a client that sends a byte now and then holds its connection, a file
descriptor and uvicorn's per-connection state for ever, and a few hundred such sockets
exhaust the server. :class:`TimeoutH11Protocol` (uvicorn's own h11 protocol, subclassed)
adds two deadlines, both absolute, so trickling bytes does not extend them:

* header: from the connection's start, or the end of the previous response on a
  keep-alive connection, to a complete request head (``header_timeout_s``);
* body: from the request head to the end of its body (``body_timeout_s``).

Past a deadline the connection is closed; a client that had sent part of a request and no
response has started gets ``408`` with an OpenAI error object first (``code
"request_timeout"``; an idle connection is closed silently, as keep-alive ones are); a handler
still waiting for that body sees the client as gone. Bytes that h11 cannot parse as HTTP
(a bad ``Content-Length``, a non-ASCII target, ...) get uvicorn's 400 as an OpenAI error
object (``code "invalid_http"``) instead of plain text. :func:`uvicorn_options` are the
uvicorn options of ``pagedkv serve`` and :class:`~pagedkv.serving.threaded.ThreadedServer`:
this protocol, uvicorn's own keep-alive timeout and h11's header-size limit.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.serving.errors import APIError

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's limit on an incomplete request head


class TimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines above (class attributes,
    seconds; :func:`timeout_protocol` makes a subclass with other values)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._deadline: Optional[Any] = None  # asyncio.TimerHandle
        self._phase: Optional[str] = None
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    # ---- deadlines --------------------------------------------------------------------
    def _track(self) -> None:
        """Arm the deadline of the phase the client is in (a new phase, a new deadline)."""
        if self.transport.is_closing():
            self._set_phase(None)
            return
        state = self.conn.their_state
        self._set_phase("header" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _set_phase(self, phase: Optional[str]) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "header" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _expired(self, phase: str, timeout: float) -> None:
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        started_head = phase == "body" or bool(self.conn.trailing_data[0])
        # an idle connection (no byte of a request yet) is closed silently, as uvicorn's
        # keep-alive timeout does: a client may be about to reuse it and must not read a 408
        if started_head and (cycle is None or not cycle.response_started):
            what = "request head" if phase == "header" else "request body"
            self._write_error(408, b"Request Timeout", f"the {what} did not arrive within {timeout:g} s",
                              "request_timeout")
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the handler's receive() answers http.disconnect
            cycle.message_event.set()
        self.transport.close()

    # ---- protocol errors ----------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse, as an OpenAI error object; closes."""
        self._write_error(400, b"Bad Request", msg, "invalid_http")
        self.transport.close()

    def _write_error(self, status: int, reason: bytes, message: str, code: str) -> None:
        """Write a whole ``Connection: close`` response outside h11 (the caller closes)."""
        body = json.dumps(APIError(status, message, code=code).body()).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))


def timeout_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> type[TimeoutH11Protocol]:
    """A :class:`TimeoutH11Protocol` with these deadlines (seconds, > 0; ``ValueError``)."""
    if not (header_timeout_s > 0 and body_timeout_s > 0):
        raise ValueError(f"timeouts must be > 0 s, got header {header_timeout_s}, body {body_timeout_s}")
    return type("TimeoutH11Protocol", (TimeoutH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s)})


def uvicorn_options(*, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, keep_alive_s: int = DEFAULT_KEEP_ALIVE_S,
                    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config``: the timeout protocol;
    ``keep_alive_s``: idle seconds after a response before uvicorn closes the connection;
    ``max_header_bytes``: h11's limit on a request head still arriving (bytes; past it 400)."""
    return {"http": timeout_protocol(header_timeout_s, body_timeout_s), "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": max_header_bytes}
