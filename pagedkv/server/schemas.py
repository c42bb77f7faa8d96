"""OpenAI-compatible request and response bodies (pydantic v2), and the error object.

Only the fields pagedkv implements are declared; unknown fields are ignored (the official
clients send a few optional ones). Extensions beyond OpenAI, named as in vLLM:
``cache_salt`` (str: keeps this request's prefix-cache blocks apart from requests with
another salt), ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``.

Schema checks (types, ranges such as ``temperature >= 0``) fail with HTTP 422; checks that
need the model or the server's limits (context length, ``n`` above the server's maximum,
unknown model) are made by the routes (400 / 404). Units: every length is in tokens.

The sampling ranges are the engine's (``SamplingParams.TOP_P_RANGE`` ...), so a request
this schema accepts passes ``SamplingParams.validate()``; the limits below are the HTTP
API's own (body size, and OpenAI's ``temperature <= 2``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from pagedkv.engine.request import SamplingParams

# Size limits of one request body (besides the byte limit of the body-size dependency).
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_PROMPTS = 16  # prompts in one /v1/completions call
MAX_MESSAGES = 256
MAX_SALT_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_USER_CHARS = 256
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI API's range; the engine itself only needs >= 0

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # completions ``logprobs`` / chat ``top_logprobs``
_TOP_P = SamplingParams.TOP_P_RANGE
_MIN_P = SamplingParams.MIN_P_RANGE
_PENALTY = SamplingParams.PENALTY_RANGE

Number = Union[StrictInt, StrictFloat]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(BaseModel):
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: StrictInt = Field(1, ge=1)
    temperature: Optional[Number] = Field(None, ge=SamplingParams.MIN_TEMPERATURE, le=OPENAI_MAX_TEMPERATURE)
    top_p: Optional[Number] = Field(None, gt=_TOP_P[0], le=_TOP_P[1])
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS)
    presence_penalty: Optional[Number] = Field(None, ge=_PENALTY[0], le=_PENALTY[1])
    frequency_penalty: Optional[Number] = Field(None, ge=_PENALTY[0], le=_PENALTY[1])
    # extensions (vLLM names)
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = Field(None, ge=_MIN_P[0], le=_MIN_P[1])
    repetition_penalty: Optional[Number] = Field(None, gt=0.0)
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Optional[list[str]]:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop sequences must be 1..{MAX_STOP_CHARS} characters")
        return stops or None

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and "\x00" in v:
            raise ValueError("cache_salt must not contain NUL characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be >= 0")
        return v


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists (at most ``MAX_PROMPTS`` prompts). ``logprobs``: the
    number of top alternatives per token (0..20) or null."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
                if any(len(p) == 0 for p in v):
                    raise ValueError("prompt must not be empty")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list (one entry per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the room left in the context. ``logprobs``: bool; ``top_logprobs``: 0..20
    alternatives per token."""

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)


# ---- responses (plain dicts are built by the app; these document their shape) ----------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[dict[str, int]] = None  # {"cached_tokens": prefix-cache hit}
