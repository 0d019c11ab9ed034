"""POST /v1/completions: the legacy text API (prompt strings or token ids; default max_tokens 16)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.request import CompletionOutput
from .engine_loop import RequestStream
from .errors import bad_request
from .generation import ServerState, collect, created, openai_frames, unless_disconnected, usage_openai
from .params import build_sampling_params, check_model, check_prompt_length, check_stream_options, read_body
from .protocol import CompletionRequest
from .structured_request import from_chat
from .sse import data_frame, sse_response


def completion_logprobs(c: CompletionOutput, start: int, end: int, offset: int) -> dict[str, Any]:
    """The legacy `logprobs` object for tokens [start, end): tokens, token_logprobs, top_logprobs, offsets."""
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token or "")
        lps.append(chosen.logprob)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in ranked})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


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
        if body.stream and len(prompts) > 1:
            raise bad_request("streaming takes one prompt per request; send the prompts separately", "prompt")
        fields = body.model_dump()  # with vLLM's structured_outputs / guided_* extras
        params = build_sampling_params(fields, defaults=s.defaults, config=s.config,
                                       max_tokens=body.max_tokens, logprobs=body.logprobs,
                                       vocab_size=s.renderer.tokenizer.vocab_size,
                                       structured_outputs=from_chat(fields, s.config.structured_disable_any_whitespace))
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
            frames = self._stream(streams[0], prompts[0], body, request_id, bool(opts and opts.include_usage))
            return sse_response(openai_frames(frames, streams[0]), s.config.sse_keep_alive_interval,
                                streams[0].close, ready=streams[0].started)
        results = await unless_disconnected(request, asyncio.gather(*(collect(st) for st in streams)))
        choices, flat = [], []
        for p_index, ((text, ids), completions) in enumerate(zip(prompts, results)):
            for c in completions:
                echo = text if body.echo else ""
                choices.append({"index": p_index * params.n + c.index, "text": echo + c.text,
                                "logprobs": completion_logprobs(c, 0, len(c.token_ids), len(echo))
                                if body.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                flat.append(c)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created(),
                             "model": s.config.served_model_name, "choices": choices,
                             "usage": usage_openai(sum(len(ids) for _, ids in prompts), flat)})

    async def _stream(self, stream: RequestStream, prompt: tuple[str, list[int]], body: CompletionRequest,
                      request_id: str, include_usage: bool) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": created(),
                "model": self.state.config.served_model_name}
        sent_text, sent_tokens, last = [0] * body.n, [0] * body.n, {}
        if body.echo:
            for i in range(body.n):
                yield data_frame({**head, "choices": [{"index": i, "text": prompt[0], "logprobs": None,
                                                       "finish_reason": None}]})
        async for out in stream:
            c = out.outputs[0]
            i, last[c.index] = c.index, c
            text = c.text[sent_text[i]:]
            logprobs = completion_logprobs(c, sent_tokens[i], len(c.token_ids), sent_text[i]) \
                if body.logprobs is not None else None
            sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
            if text or c.finish_reason is not None:
                yield data_frame({**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                                       "finish_reason": c.finish_reason,
                                                       "stop_reason": c.stop_reason}]})
        if include_usage:
            yield data_frame({**head, "choices": [], "usage": usage_openai(len(prompt[1]), list(last.values()))})


def completions_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/completions", Completions(state), methods=["POST"])
    return router
