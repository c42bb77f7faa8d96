"""OpenAI-compatible request and response bodies (pydantic v2), and the error object.

Only the fields pagedkv implements are declared, and each is honoured. An OpenAI parameter
it does not implement (``UNSUPPORTED``: ``suffix``, ``audio``, ...) is
refused with a 400 naming it when set to anything but its "off" value; other unknown fields
are ignored (clients send a few optional ones). Extensions beyond OpenAI, named as in vLLM:
``cache_salt`` (str: keeps this request's prefix-cache blocks apart from requests with
another salt), ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids`` (the stop token's text, and a matched stop string, are not in the text
unless ``include_stop_str_in_output``), ``min_tokens`` (no EOS, stop token or stop string ends
a request before it has that many tokens), chat's ``add_generation_prompt`` and
``continue_final_message``, and structured outputs: OpenAI's ``response_format`` (``json_object``,
``json_schema``) or one of ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (docs/structured_outputs.md). ``logit_bias`` (token id as a decimal string -> bias in [-100, 100])
and ``best_of`` (generate ``best_of`` samples, return the ``n`` with the highest cumulative
logprob; not with ``stream``) are OpenAI's.

Schema checks (types, ranges such as ``temperature >= 0``) fail with HTTP 422; checks that
need the model or the server's limits (context length, token ids in the vocabulary, ``n``
above the server's maximum, unknown model) are made by the routes (400 / 404). Units:
every length is in tokens. Bodies reach these models through
:func:`pagedkv.serving.validation.parse_json_body` (depth, integer size, Unicode).

The sampling ranges are the engine's (``SamplingParams.TOP_P_RANGE`` ...), so a request
this schema accepts passes ``SamplingParams.validate()``; the limits below are the HTTP
API's own (body size, and OpenAI's ``temperature <= 2``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StringConstraints, field_validator, model_validator

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

MAX_MODEL_NAME_CHARS = 256
MAX_DETOKENIZE_TOKENS = 1 << 17  # token ids in one /detokenize call

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # completions ``logprobs`` / chat ``top_logprobs``
_TOP_P = SamplingParams.TOP_P_RANGE
_MIN_P = SamplingParams.MIN_P_RANGE
_PENALTY = SamplingParams.PENALTY_RANGE
_REP_PENALTY = SamplingParams.REPETITION_PENALTY_RANGE
_BIAS = SamplingParams.LOGIT_BIAS_RANGE

Number = Union[StrictInt, StrictFloat]
INT64 = (-(2**63), 2**63 - 1)
# a token id; the published OpenAPI document adds the vocabulary's bound (``x-token-id``)
TokenId = Annotated[StrictInt, Field(ge=0, json_schema_extra={"x-token-id": True})]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
StopStr = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
Bias = Annotated[Number, Field(ge=_BIAS[0], le=_BIAS[1])]

# OpenAI parameters pagedkv does not implement -> the values that mean "off" (None, false,
# "", [] and {} always do): set to anything else, a request is refused with 400.
_UNSUPPORTED_COMMON: dict[str, tuple] = {
    "tools": (), "tool_choice": ("none", "auto"), "functions": (), "function_call": ("none", "auto"),
    "parallel_tool_calls": (), "audio": (),
    "modalities": (["text"],), "prediction": (), "web_search_options": (),
}


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


MAX_CHOICES = 1024  # guided_choice strings
MAX_TOOLS = 128  # tools of one chat call (OpenAI's limit)
MAX_FORMAT_NAME_CHARS = 64  # response_format.json_schema.name (OpenAI's limit)


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: ``schema`` (a JSON schema object; absent = any JSON
    object), ``name``, ``description`` and ``strict`` (accepted; the output always matches
    the schema, strict or not)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=MAX_FORMAT_NAME_CHARS)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (off), ``{"type": "json_object"}``
    (any JSON object) or ``{"type": "json_schema", "json_schema": {...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., max_length=MAX_MODEL_NAME_CHARS)
    n: StrictInt = Field(1, ge=1)
    best_of: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[Number] = Field(None, ge=SamplingParams.MIN_TEMPERATURE, le=OPENAI_MAX_TEMPERATURE)
    top_p: Optional[Number] = Field(None, gt=_TOP_P[0], le=_TOP_P[1])
    seed: Optional[StrictInt] = Field(None, ge=INT64[0], le=INT64[1])
    stop: Optional[Union[StopStr, Annotated[list[StopStr], Field(max_length=MAX_STOP_SEQUENCES)]]] = None
    logit_bias: Optional[dict[TokenIdKey, Bias]] = Field(None, max_length=SamplingParams.MAX_LOGIT_BIAS)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS)
    presence_penalty: Optional[Number] = Field(None, ge=_PENALTY[0], le=_PENALTY[1])
    frequency_penalty: Optional[Number] = Field(None, ge=_PENALTY[0], le=_PENALTY[1])
    # extensions (vLLM names)
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = Field(None, ge=_MIN_P[0], le=_MIN_P[1])
    repetition_penalty: Optional[Number] = Field(None, ge=_REP_PENALTY[0], le=_REP_PENALTY[1])
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # tokens generated before EOS / stop_token_ids / stop strings may end the request (<= max_tokens: 400)
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False  # keep the matched stop string / stop token's text
    # structured outputs (at most one; pagedkv.serving.protocol.structured_spec)
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None  # a JSON schema (object or its text)
    guided_regex: Optional[NonEmptyStr] = None
    guided_choice: Optional[Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]] = None
    guided_grammar: Optional[NonEmptyStr] = None  # EBNF/GBNF (``root ::= ...``) or Lark

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Optional[list[str]]:
        if v is None:
            return None
        return ([v] if isinstance(v, str) else list(v)) or None

    def token_biases(self) -> Optional[dict[int, float]]:
        """``logit_bias`` with int token ids (None when unset or empty)."""
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and "\x00" in v:
            raise ValueError("cache_salt must not contain NUL characters")
        return v


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists (at most ``MAX_PROMPTS`` prompts). ``logprobs``: the
    number of top alternatives per token (0..20) or null; with ``echo`` the prompt's tokens
    get entries too (the first one's logprob null). ``max_tokens`` 0 needs ``echo``."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_UNSUPPORTED_COMMON, "suffix": ()}

    prompt: Union[NonEmptyStr, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=MAX_PROMPTS)]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0)  # 0: only with echo (prompt logprobs)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (it returns the prompt and its logprobs)")
        return self

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
    """One message. ``tool_calls`` (an assistant's earlier calls) and ``tool_call_id`` (a
    tool result's call) are rendered as text (:mod:`pagedkv.serving.tools`)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)]] = None
    tool_call_id: Optional[str] = Field(None, max_length=MAX_USER_CHARS)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(BaseModel):
    """A tool's function: ``name`` (1-64 of ``A-Za-z0-9_.-``), ``description``,
    ``parameters`` (a JSON schema of its arguments object; absent = any object)."""

    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """``tool_choice`` forcing one function: ``{"type": "function", "function": {"name"}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the room left in the context. ``logprobs``: bool; ``top_logprobs``: 0..20
    alternatives per token. ``add_generation_prompt`` (default true) /
    ``continue_final_message`` (default false; needs ``add_generation_prompt: false`` and a
    last message from the assistant, else 400): see ``pagedkv.model.tokenizer.apply_chat``.
    ``tools`` / ``tool_choice`` (``none``, ``auto``, ``required``
    or a named function) / ``parallel_tool_calls``: :mod:`pagedkv.serving.tools`."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **{k: v for k, v in _UNSUPPORTED_COMMON.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")},
        "echo": (), "suffix": ()}

    tools: Optional[Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    # vLLM's chat template flags: both true is a 400; continue_final_message needs the last
    # message to be the assistant's (400) and leaves it open for the model to continue
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): exactly one of ``prompt`` (text; with
    ``add_special_tokens``, default true) or ``messages`` (through the chat template; with
    ``add_generation_prompt``, default true, or ``continue_final_message``). ``return_token_strs``: also each token's
    text. Answer: ``{"count", "max_model_len", "tokens", "token_strs"}``."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): ``tokens`` (ids in the vocabulary, checked by
    the route: 400) -> ``{"prompt": text}``."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    tokens: list[TokenId] = Field(..., max_length=MAX_DETOKENIZE_TOKENS)


# ---- responses (plain dicts are built by the app; these document their shape) ----------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[dict[str, int]] = None  # {"cached_tokens": prefix-cache hit}
