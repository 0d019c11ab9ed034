"""Request plumbing shared by the routes: body parsing, the model check, sampling limits, prompt length.

Everything here raises APIError (4xx) so that a stream never starts for a request that cannot run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from ..engine.structured import StructuredOutputsParams
from .config import ServerConfig
from .errors import APIError, bad_request
from .protocol import SamplingFields

Body = TypeVar("Body", bound=BaseModel)

# name -> (lowest, highest, include lowest, include highest, how to say it)
_RANGES: dict[str, tuple[float, float, bool, bool, str]] = {
    "temperature": (0.0, 2.0, True, True, "in [0, 2]"),
    "top_p": (0.0, 1.0, False, True, "in (0, 1]"),
    "min_p": (0.0, 1.0, True, True, "in [0, 1]"),
    "presence_penalty": (-2.0, 2.0, True, True, "in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, True, True, "in [-2, 2]"),
    "repetition_penalty": (0.0, math.inf, False, False, "a finite number > 0"),
}


async def read_body(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The JSON body validated against `model`; 400 for a wrong content type or bad JSON, 413 when too big."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {content_type or 'none'!r}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # refuse before buffering it
        raise APIError(413, f"The request body has {declared} bytes; the limit is {max_bytes}")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(413, f"The request body has {len(raw)} bytes; the limit is {max_bytes}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise bad_request(f"The request body is not valid JSON{where}; send a JSON object") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(data).__name__}")
    return model.model_validate(data)  # ValidationError -> 400 in errors.py


def check_model(name: str | None, config: ServerConfig, required: bool = False) -> None:
    """An empty or omitted model selects the served one on OpenAI routes; anything else must match."""
    if not name:
        if required:
            raise bad_request("model is required; use " + repr(config.served_model_name), "model")
        return
    if name not in (*config.served_model_names, config.model_path):
        raise APIError(404, f"The model `{name}` does not exist. Valid aliases: "
                       f"{', '.join(config.served_model_names)}.",
                       "model")


def check_stream_options(stream: bool | None, stream_options: object) -> None:
    """OpenAI's rule for chat and completions: stream_options only with stream=true."""
    if stream_options is not None and not stream:
        raise bad_request("stream_options can only be set together with stream=true", "stream_options")


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                          f"contains {num_tokens} input tokens, which exceeds this limit even without any output "
                          "tokens. Shorten the prompt.", "input_tokens")
    if num_tokens == 0:
        raise bad_request("The prompt is empty; give at least one token", "prompt")


def check_top_logprobs(top_logprobs: int | None) -> None:
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", "top_logprobs")


def build_sampling_params(fields: Mapping[str, Any], *, defaults: SamplingParams, config: ServerConfig,
                          max_tokens: int | None, max_tokens_param: str = "max_tokens",
                          logprobs: int | None = None, vocab_size: int | None = None,
                          structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams from request fields (None = not given), with the API's limits checked first.
    `structured_outputs` comes from structured_request.py (already checked). Fields a route's body model
    does not declare (vLLM extras such as `stop` on /v1/responses) are type-checked here like declared ones."""
    fields = _typed_sampling_fields(fields)
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        if max_tokens > config.max_model_len:
            raise bad_request(f"{max_tokens_param}={max_tokens} cannot be greater than "
                              f"max_model_len={config.max_model_len}", max_tokens_param)
    for name, (lo, hi, lo_in, hi_in, says) in _RANGES.items():
        v = fields.get(name)
        if v is None:
            continue
        ok = math.isfinite(v) and (lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)
        if not ok:
            raise bad_request(f"{name} must be {says}, got {v}", name)
    top_k = fields.get("top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or at least 1, got {top_k}", "top_k")
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"At most {config.max_stop_strings} stop strings are supported, got {len(stops)}", "stop")
    n = 1 if fields.get("n") is None else fields["n"]  # n=0 is an error, not the default
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if n > config.max_n:
        raise bad_request(f"n={n} is more than the {config.max_n} choices one request may ask for: send several "
                          "requests", "n")
    temperature = fields.get("temperature")
    temperature = defaults.temperature if temperature is None else temperature
    if n > 1 and temperature == 0:
        raise bad_request("n > 1 needs sampling: greedy decoding (temperature=0) gives n identical choices; "
                          "set temperature > 0 or n=1", "n")
    check_top_logprobs(logprobs)
    logit_bias = _logit_bias(fields.get("logit_bias"), vocab_size)
    kwargs: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens, "n": n, "stop": stops or None,
                              "logprobs": logprobs, "structured_outputs": structured_outputs, "logit_bias": logit_bias}
    for name in ("top_p", "top_k", "min_p"):
        value = fields.get(name)
        kwargs[name] = getattr(defaults, name) if value is None else value
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop_token_ids",
                 "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
                 "thinking_token_budget"):
        if fields.get(name) is not None:
            kwargs[name] = fields[name]
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams' own checks: report the field it names
        message = str(e).replace("SamplingParams.", "")
        return _raise(message, message.split("=")[0] if "=" in message else None)


def _logit_bias(bias: Mapping[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with the ids checked against the tokenizer's vocabulary (vLLM's 400)."""
    if not bias:
        return None
    try:
        ids = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers, as JSON strings), got "
                          f"{[k for k in bias if not k.strip().lstrip('-').isdigit()][:5]}", "logit_bias") from None
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise bad_request(f"logit_bias has token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                          "get ids from /tokenize", "logit_bias")
    return ids


def _typed_sampling_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` with every sampling field it gives validated against SamplingFields' types (ValidationError
    -> 400 naming the field, errors.py), so an undeclared extra of the wrong type cannot reach the engine."""
    given = {k: v for k, v in fields.items() if k in SamplingFields.model_fields and v is not None}
    typed = SamplingFields.model_validate(given).model_dump(include=set(given))
    return {**fields, **typed}  # thinking_token_budget and the ranges: SamplingParams' own checks, below


def _raise(message: str, param: str | None) -> SamplingParams:
    raise bad_request(message, param)
