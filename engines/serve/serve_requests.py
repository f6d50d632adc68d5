"""Request bodies of `palaestra serve`, as strict pydantic models, and the error they turn into.

Field names and ranges follow OpenAI's ``CompletionCreateParams`` (chat and legacy completions,
read off the openai client's types) and SGLang's ``SamplingParams``. Types are strict, as a JSON
schema is: ``"5"`` and ``2.7`` are not integers, ``1`` is not a boolean, ``NaN`` is no number.
Unknown keys are ignored on the OpenAI routes (clients send provider extras), refused in SGLang's
``sampling_params`` (`SamplingParams.from_sglang` says which keys exist). Bounds that depend on the
server (``n``, ``max_tokens``, the context, the vocabulary) are checked by the handlers against
`ServeLimits`. Every problem becomes a `BadRequest`: the handlers answer it with OpenAI's error
body on ``/v1/*`` and SGLang's on the native routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from palaestra.errors import ConfigError

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
_CODES = {
    "missing": "missing_required_parameter", "greater_than_equal": "below_min_value",
    "greater_than": "below_min_value", "less_than_equal": "above_max_value",
    "less_than": "above_max_value", "too_long": "array_above_max_length",
    "too_short": "empty_array", "literal_error": "invalid_value", "extra_forbidden":
    "unknown_parameter", "finite_number": "invalid_value",
}


class BadRequest(ConfigError):
    """A request the server refuses: ``(message, param, code, status)``, picklable via ``args``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message, param, code, status)
        self.message, self.param, self.code, self.status = message, param, code, status

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask of the server (``palaestra serve --max-n`` and friends)."""

    max_n: int = 128  #: samples per request (OpenAI's bound for chat ``n``)
    max_batch: int = 1024  #: sequences per request: prompts x n
    max_new_tokens: int | None = None  #: tokens per sequence (None: the context length)
    max_stop: int = 16  #: stop strings (OpenAI allows 4 on /v1; this bounds SGLang's list)
    max_stop_chars: int = 256
    max_token_ids: int = 1024  #: entries of logit_bias / stop_token_ids

    def __post_init__(self) -> None:
        for name in ("max_n", "max_batch", "max_stop", "max_stop_chars", "max_token_ids"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ServeLimits.{name} must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError("ServeLimits.max_new_tokens must be >= 1 (or None: the context)")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _OpenAISampling(_Strict):
    model: str | None = None
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # SGLang/vLLM extra
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # SGLang extra
    skip_special_tokens: bool | None = None  # SGLang extra


class ToolCallFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One message of ``messages`` (text content; multi-part content as its text parts)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    """``POST /v1/chat/completions`` (OpenAI's chat ``CompletionCreateParams``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang/vLLM extra


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions`` (OpenAI's legacy ``CompletionCreateParams``)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; 0 with echo scores a prompt
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class SGLangSamplingParams(_Strict):
    """SGLang's ``sampling_params`` object of ``/generate`` (unknown keys refused)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0, le=2)
    min_new_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)


def _param(loc: tuple[Any, ...], prefix: str) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part.startswith(("function-", "literal")):
            continue  # a union branch's tag, not a field
        else:
            out += f".{part}" if out else part
    return out


def parse(model: type[_Strict], body: object, *, prefix: str = "") -> Any:
    """``model`` validated from a JSON body; `BadRequest` naming every bad field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body{' ' + prefix if prefix else ''} must be a JSON "
                         f"object, got {type(body).__name__}", prefix or None, "invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _bad_request(exc, prefix) from None


def _bad_request(exc: ValidationError, prefix: str) -> BadRequest:
    seen: dict[str, tuple[str, str, Any]] = {}
    for err in exc.errors(include_url=False):
        param = _param(tuple(err["loc"]), prefix)
        if param in seen:  # the other branches of a union: one line per field
            continue
        seen[param] = (err["type"], err["msg"], err.get("input"))
    lines = []
    for param, (kind, msg, value) in seen.items():
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        lines.append(f"Invalid value for '{param}': {msg}"
                     + ("" if kind == "missing" else f", got {shown}"))
    first, (kind, _, _) = next(iter(seen.items()))
    code = _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    return BadRequest("; ".join(lines) + ".", first, code)


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """Every id in [0, vocab): a clear 400 instead of an IndexError from the model."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"Invalid value for '{param}': token ids {bad[:3]} are outside the "
                         f"vocabulary [0, {vocab}).", param, "invalid_value")


def logit_bias(bias: dict[str, float] | None, vocab: int, limits: ServeLimits,
               bound: float | None = 100.0) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> bias in [-100, 100]) as engine pairs."""
    if not bias:
        return ()
    if len(bias) > limits.max_token_ids:
        raise BadRequest(f"logit_bias has {len(bias)} entries; at most {limits.max_token_ids}.",
                         "logit_bias", "invalid_value")
    out = []
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise BadRequest(f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id (a "
                             "decimal integer string).", "logit_bias", "invalid_value")
        if bound is not None and not -bound <= value <= bound:
            raise BadRequest(f"Invalid value in 'logit_bias' for {key}: {value} is outside "
                             f"[-{bound:g}, {bound:g}].", "logit_bias", "invalid_value")
        out.append((int(key), float(value)))
    check_token_ids([k for k, _ in out], vocab, "logit_bias")
    return tuple(out)


def stop_strings(stop: str | list[str] | None, limits: ServeLimits, most: int | None = None
                 ) -> tuple[str, ...]:
    """``stop`` as a tuple, within the count and length bounds (empty strings dropped)."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    most = limits.max_stop if most is None else most
    if len(stops) > most:
        raise BadRequest(f"'stop' has {len(stops)} sequences; at most {most}.", "stop",
                         "invalid_value")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise BadRequest(f"a 'stop' sequence is longer than {limits.max_stop_chars} characters.",
                         "stop", "invalid_value")
    return tuple(s for s in stops if s)


def check_n(n: int, limits: ServeLimits, prompts: int = 1) -> None:
    """``n`` (already >= 1) and the request's sequence count within the server's limits."""
    if n > limits.max_n:
        raise BadRequest(f"Invalid value for 'n': {n} is above this server's maximum of "
                         f"{limits.max_n} (palaestra serve --max-n).", "n", "above_max_value")
    if n * prompts > limits.max_batch:
        raise BadRequest(f"the request asks for {n * prompts} sequences ({prompts} prompts x n="
                         f"{n}); this server takes at most {limits.max_batch} per request "
                         "(palaestra serve --max-batch).", "n", "above_max_value")


def new_tokens(requested: int | None, prompt_len: int, context: int, limits: ServeLimits,
               param: str = "max_tokens", *, clamp: bool = False) -> int:
    """Tokens to generate: ``requested`` (None: what the context leaves) within the bounds.

    ``clamp`` (SGLang's /generate) lets the engine stop at the context end; otherwise a request
    that cannot fit is refused with OpenAI's ``context_length_exceeded``.
    """
    room = context - prompt_len
    if room <= 0:
        raise BadRequest(f"This model's maximum context length is {context} tokens; the prompt "
                         f"has {prompt_len} tokens.", "messages" if param != "max_new_tokens"
                         else "input_ids", "context_length_exceeded")
    cap = min(context, limits.max_new_tokens or context)
    if requested is None:
        return min(room, cap)
    if requested > cap:
        raise BadRequest(f"Invalid value for '{param}': {requested} is above this server's "
                         f"maximum of {cap} tokens (the context length or --max-new-tokens).",
                         param, "above_max_value")
    if requested > room and not clamp:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
            "completion). Please reduce the prompt or the completion length.", param,
            "context_length_exceeded")
    return requested


__all__ = [
    "BadRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SGLangSamplingParams",
    "ServeLimits",
    "StreamOptions",
    "check_n",
    "check_token_ids",
    "logit_bias",
    "new_tokens",
    "parse",
    "stop_strings",
]
