"""The OpenAI request bodies the gateway accepts, validated with pydantic.

Types are checked strictly (a string where a number belongs is a 400, as with OpenAI); fields this module
does not know are kept and forwarded, so newer client options still reach engines that understand them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from gateway.http.errors import InvalidRequest

TokenId = Annotated[int, Field(ge=0, lt=2**32)]
# No count of stop strings: OpenAI documents "up to 4", but vLLM takes any number (kvgate's engines refuse a
# fifth themselves): the gateway does not refuse what the engine behind it takes.
StopSpec = Annotated[str, StringConstraints(min_length=1)] | list[str]


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class _Common(_Open):
    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: StopSpec | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    cache_salt: Annotated[str, StringConstraints(max_length=256)] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_with_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # OpenAI and vLLM refuse stream_options without stream: true; kvgate's engines would drop them and
        # answer 200. An empty object passes, as vLLM lets it (it refuses only a non-empty one).
        given = options is not None and bool(options.model_fields_set or options.model_extra)
        if given and info.data.get("stream") is not True:
            raise PydanticCustomError("stream_options", "only allowed when stream is true")
        return options


class TextPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # (A part may be a plain string: vLLM reads it as a text part.)
    content: str | list[TextPart | str] | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _says_something(cls, content: Any, info: ValidationInfo) -> Any:
        # As OpenAI: only an assistant's message (it then carries tool calls) and a legacy function result
        # (ChatCompletionFunctionMessageParam: content "Required[Optional[str]]") may go without content.
        if content is None and info.data.get("role", "assistant") not in ("assistant", "function"):
            raise PydanticCustomError("missing", "field required")
        return content


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = None


class ResponsesRequest(_Open):
    """OpenAI's Responses API (``POST /v1/responses``): what routing and billing read of it. The input's items
    are checked where they are rendered (``cache.responses_input``), as vLLM converts them."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # (include_obfuscation: not about usage, always sent)
    store: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    user: str | None = None
    cache_salt: Annotated[str, StringConstraints(max_length=256)] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None  # (engines keep it with the response: OpenAI's and vLLM's type)

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, background: bool | None) -> bool | None:
        # A background response is polled for later (GET /v1/responses/{id}) and billed by nobody: the
        # gateway relays and bills the answer it carries.
        if background:
            raise PydanticCustomError("background", "background responses are not supported by this gateway")
        return background


class EmbeddingsRequest(_Open):
    """``POST /v1/embeddings``, as OpenAI and vLLM take it. Its ``input`` (or vLLM's ``messages``) is read by
    ``gateway.embedding_inputs``, which says for each form what is wrong with it."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    input: Any = None
    messages: Any = None
    encoding_format: str | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: Annotated[str, StringConstraints(max_length=256)] | None = None


_Request = TypeVar("_Request", ChatCompletionRequest, CompletionRequest, ResponsesRequest, EmbeddingsRequest)
_CHAT = TypeAdapter(ChatCompletionRequest)
_COMPLETION = TypeAdapter(CompletionRequest)
_RESPONSES = TypeAdapter(ResponsesRequest)
_EMBEDDINGS = TypeAdapter(EmbeddingsRequest)
_CONVERSATION = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])


# Fields typed as unions: pydantic reports one error per member, which reads badly; say what is accepted.
_UNION_HINTS = {
    "prompt": "must be a string, an array of strings, an array of token ids (integers in [0, 2**32)) "
    "or an array of such arrays",
    "content": "must be a string, null, or an array of content parts",
    "stop": "must be a non-empty string or an array of strings",
    "input": "must be a string or an array of input items (objects)",
}
_UNION_TAGS = ("list[", "constrained-", "function-", "nullable[", "union[")
_UNION_NAMES = frozenset({"str", "int", "float", "bool", "none", "StreamOptions", "TextPart"})
# The longest part of an error's ``param`` path: a part may be a key of the client's own (``metadata``'s,
# ``logit_bias``'s), which came back whole, twice (in the message and the param), however long it was.
_MAX_PARAM_PART = 64


def _invalid(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    raw = [str(p)[:_MAX_PARAM_PART] for p in err["loc"]]
    path: list[str] = []
    for i, part in enumerate(raw):
        if part in _UNION_NAMES or part.startswith(_UNION_TAGS):
            field = path[-1] if path else ""
            if field in _UNION_HINTS and i > 0:
                where = ".".join(path)
                return InvalidRequest(f"{where}: {_UNION_HINTS[field]}", param=where)
            continue
        path.append(part)
    param = ".".join(path) or None
    msg = "field required" if err["type"] == "missing" else err["msg"]
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


# What the gateway alone tells an engine: where to fetch K/V from (an engine would connect to any URL a client
# named: kvgate's and vLLM's kv_transfer_params, SGLang's bootstrap host, port and room), which leading blocks
# are hashed in the shared, salt-less namespace (another tenant's cache), and the prompt's ids, packed or not
# (an engine prefers them to the prompt the gateway routed and billed).
GATEWAY_FIELDS = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "cache_shared_blocks",
    "prompt_token_ids_hex",
    "prompt_token_ids",
)
# vLLM keeps a Responses request's answer, and at once its conversation, under the request's own
# ``request_id`` (an extra field of its, "resp_<uuid>" by default): a client naming one could name another
# tenant's stored response and overwrite it on its engine. Only the engine picks a response's id.
RESPONSES_ENGINE_FIELDS = ("request_id",)


def _parse(adapter: TypeAdapter[_Request], body: Any) -> _Request:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    for field in GATEWAY_FIELDS:
        if field in body:
            raise InvalidRequest(f"{field} is set by the gateway, not by clients", param=field)
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def parse_chat(body: Any) -> ChatCompletionRequest:
    return _parse(_CHAT, body)


def parse_completion(body: Any) -> CompletionRequest:
    return _parse(_COMPLETION, body)


def parse_responses(body: Any) -> ResponsesRequest:
    if isinstance(body, dict):
        for field in RESPONSES_ENGINE_FIELDS:
            if field in body:
                raise InvalidRequest(
                    f"{field} is not taken: the engine names the response it keeps", param=field
                )
    return _parse(_RESPONSES, body)


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    return _parse(_EMBEDDINGS, body)


def check_conversation(messages: Any, where: str) -> None:
    """A conversation given outside a chat request (an embeddings request's), checked as a chat's messages
    are; errors name ``where`` (``messages.1.content``, say)."""
    try:
        _CONVERSATION.validate_python(messages)
    except ValidationError as exc:
        error = _invalid(exc)
        param = f"{where}.{error.param}" if error.param else where
        raise InvalidRequest(f"{where}.{error.message}", param=param) from None
