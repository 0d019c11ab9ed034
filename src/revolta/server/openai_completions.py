"""POST /v1/completions: the legacy text API (prompt strings or token ids; default max_tokens 16).

`echo` puts the prompt before the answer; with `logprobs` the choice's logprobs then cover the prompt's
tokens too (the first one's logprob null: nothing predicts it), then the generated ones. `echo` with
`max_tokens: 0` returns the prompt alone with its logprobs (scoring, e.g. lm-eval's loglikelihood), as vLLM.
Several prompts (strings or token-id lists) give choice index prompt * n + sample, streamed or not, as vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.request import CompletionOutput, Logprob, PromptLogprobs
from .engine_loop import RequestStream
from .errors import bad_request
from .generation import (ServerState, collect, created, json_logprob, openai_frames, unless_disconnected,
                         usage_openai)
from .params import build_sampling_params, check_model, check_prompt_length, check_stream_options, read_body
from .protocol import CompletionRequest
from .structured_request import from_chat
from .sse import data_frame, merged, sse_response


def legacy_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int,
                    decode: Callable[[int], str]) -> dict[str, Any]:
    """The legacy `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset. An entry of None (the
    first prompt token) gives a null logprob and null top_logprobs, its text from `decode`."""
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id] if entry is not None else None
        text = (chosen.decoded_token or "") if chosen is not None else decode(token_id)
        tokens.append(text)
        lps.append(json_logprob(chosen.logprob) if chosen is not None else None)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0) if entry is not None else []
        tops.append({(lp.decoded_token or ""): json_logprob(lp.logprob) for lp in ranked} if entry is not None
                    else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


class Completions:
    def __init__(self, state: ServerState):
        self.state = state

    async def _prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        tokenizer = self.state.renderer.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, await asyncio.to_thread(tokenizer.encode, p)))
            else:
                vocab = tokenizer.vocab_size
                if any(not 0 <= t < vocab for t in p):
                    raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
                out.append((tokenizer.decode(p, skip_special_tokens=False), list(p)))
        for _, ids in out:
            check_prompt_length(len(ids), self.state.config.max_model_len)
        return out

    async def __call__(self, request: Request) -> Any:
        s = self.state
        body = await read_body(request, CompletionRequest, s.config.max_body_bytes)
        check_model(body.model, s.config)
        check_stream_options(body.stream, body.stream_options)
        if body.suffix:
            raise bad_request("suffix is not supported by this model", "suffix")
        prompts = await self._prompts(body.prompt)
        fields = body.model_dump()  # with vLLM's structured_outputs / guided_* extras
        if body.max_tokens == 0 and not body.echo:  # vLLM refuses it too
            raise bad_request("max_tokens must be at least 1, got 0 (0 only scores the prompt: with echo=true)",
                              "max_tokens")
        echo_only = body.echo and body.max_tokens == 0  # the engine samples one token; the answer drops it
        params = build_sampling_params(fields, defaults=s.defaults, config=s.config,
                                       max_tokens=1 if echo_only else body.max_tokens, logprobs=body.logprobs,
                                       vocab_size=s.renderer.tokenizer.vocab_size,
                                       structured_outputs=from_chat(fields, s.config.structured_disable_any_whitespace))
        if body.echo and body.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        streams = []
        try:
            for _, ids in prompts:
                streams.append(await s.submit(request, {"prompt_token_ids": ids}, params))
        except Exception:
            for st in streams:
                st.close()
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            opts = body.stream_options

            def close() -> None:
                for st in streams:
                    st.close()
            frames = self._streams(streams, prompts, body, echo_only, request_id, bool(opts and opts.include_usage))
            # the prompts went in in order: the first one's first output opens the stream
            return sse_response(openai_frames(frames, close), s.config.sse_keep_alive_interval, close,
                                ready=streams[0].started)
        results = await unless_disconnected(request, asyncio.gather(*(collect(st) for st in streams)))
        choices, flat = [], []
        for p_index, (prompt, (completions, prompt_logprobs)) in enumerate(zip(prompts, results)):
            for c in completions:
                if echo_only:
                    c = dataclasses.replace(c, text="", token_ids=[], logprobs=[], finish_reason="length",
                                            stop_reason=None)
                choices.append({"index": p_index * params.n + c.index, **self._choice(c, prompt, prompt_logprobs,
                                                                                       body)})
                flat.append(c)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created(),
                             "model": s.config.served_model_name, "choices": choices,
                             "usage": usage_openai(sum(len(ids) for _, ids in prompts), flat)})

    def _decode(self, token_id: int) -> str:
        return self.state.renderer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_logprobs(self, prompt: tuple[str, list[int]], entries: PromptLogprobs | None) -> dict[str, Any]:
        if entries is None:  # the engine did not report them: a bug, not a client error
            raise RuntimeError("echo with logprobs: the engine returned no prompt logprobs")
        return legacy_logprobs(prompt[1], entries, 0, self._decode)

    def _choice(self, c: CompletionOutput, prompt: tuple[str, list[int]], prompt_logprobs: PromptLogprobs | None,
                body: CompletionRequest) -> dict[str, Any]:
        echo = prompt[0] if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = legacy_logprobs(c.token_ids, c.logprobs or [], len(echo), self._decode)
            if body.echo:
                logprobs = _joined(self._prompt_logprobs(prompt, prompt_logprobs), logprobs)
        return {"text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    async def _streams(self, streams: list[RequestStream], prompts: list[tuple[str, list[int]]],
                       body: CompletionRequest, echo_only: bool, request_id: str,
                       include_usage: bool) -> AsyncIterator[str]:
        """Every prompt's choices as their tokens come, choice index = prompt * n + sample (as vLLM), then one
        usage chunk for all of them."""
        head = {"id": request_id, "object": "text_completion", "created": created(),
                "model": self.state.config.served_model_name}
        last: dict[int, CompletionOutput] = {}  # by choice index, for the usage
        async for frame in merged([self._stream(st, prompt, p_index * body.n, body, echo_only, head, last)
                                   for p_index, (st, prompt) in enumerate(zip(streams, prompts))]):
            yield frame
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            yield data_frame({**head, "choices": [], "usage": usage_openai(prompt_tokens, list(last.values()))})

    async def _stream(self, stream: RequestStream, prompt: tuple[str, list[int]], first: int,
                      body: CompletionRequest, echo_only: bool, head: dict[str, Any],
                      last: dict[int, CompletionOutput]) -> AsyncIterator[str]:
        """One prompt's choices, indexed from `first`; each one's final output goes into `last`. The echo (with
        the prompt's logprobs, known with the first output) comes first in each choice's first chunk; with
        echo_only it is the whole choice."""
        echo = prompt[0] if body.echo else ""
        sent_text, sent_tokens, echoed = [0] * body.n, [0] * body.n, set()
        async for out in stream:
            c = out.outputs[0]
            i = c.index
            if body.echo and i not in echoed:
                echoed.add(i)
                yield data_frame({**head, "choices": [{
                    "index": first + i, "text": echo, "finish_reason": "length" if echo_only else None,
                    "stop_reason": None, "logprobs": self._prompt_logprobs(prompt, out.prompt_logprobs)
                    if body.logprobs is not None else None}]})
            if echo_only:
                if len(echoed) == body.n:
                    stream.close()  # aborts the token sampled for nothing (other prompts may still run)
                    break
                continue
            last[first + i] = c
            text = c.text[sent_text[i]:]
            logprobs = legacy_logprobs(c.token_ids[sent_tokens[i]:], (c.logprobs or [])[sent_tokens[i]:],
                                       len(echo) + sent_text[i], self._decode) if body.logprobs is not None else None
            sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
            if text or c.finish_reason is not None:
                yield data_frame({**head, "choices": [{"index": first + i, "text": text, "logprobs": logprobs,
                                                       "finish_reason": c.finish_reason,
                                                       "stop_reason": c.stop_reason}]})


def completions_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/completions", Completions(state), methods=["POST"])
    return router
