"""GET /health (+ vLLM's /ping, /version, /load), /v1/models(/{id}), /metrics; POST /tokenize, /detokenize.

The probe-type routes also answer HEAD (load balancers and k8s probes send it; FastAPI adds no HEAD to a GET)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from .. import __version__
from .chat_prompt import normalize_messages, tool_setup
from .errors import APIError, bad_request
from .generation import ServerState
from .params import check_model, read_body
from .protocol import DetokenizeRequest, TokenizeRequest


def basic_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    started = int(time.time())
    cfg = state.config

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    @router.api_route("/ping", methods=["GET", "HEAD"])
    async def ping() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @router.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": state.engine.num_in_flight})

    cards = {name: {"id": name, "object": "model", "created": started, "owned_by": "revolta",
                    "root": cfg.model_path, "parent": None, "max_model_len": cfg.max_model_len,
                    # the Anthropic SDK's models.list() reads these
                    "type": "model", "display_name": name,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
             for name in cfg.served_model_names}  # vLLM lists every --served-model-name

    @router.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(cards.values()), "has_more": False,
                             "first_id": cfg.served_model_names[0], "last_id": cfg.served_model_names[-1]})

    @router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])  # :path: served names may hold "/"
    async def model(model_id: str) -> JSONResponse:
        if model_id not in cards:
            raise APIError(404, f"The model `{model_id}` does not exist. Valid models: "
                           f"{', '.join(cfg.served_model_names)}.", "model")
        return JSONResponse(cards[model_id])

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        media = state.renderer.media_budget.metric_lines(f'model_name="{cfg.served_model_name}"')
        return PlainTextResponse(state.metrics.render(state.engine.stats) + "\n".join(media) + "\n",
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request, TokenizeRequest, cfg.max_body_bytes)
        check_model(body.model, cfg)
        tokenizer = state.renderer.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt (a string) or messages (a conversation)", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt)
        else:
            messages = normalize_messages([m.model_dump(exclude_none=True) for m in body.messages])
            rendered = await state.renderer.render(messages, tool_setup(body.tools, "none" if body.tools else None),
                                                   body.chat_template_kwargs,
                                                   add_generation_prompt=body.add_generation_prompt,
                                                   continue_final_message=body.continue_final_message,
                                                   check_length=False, request=request)
            ids = rendered.token_ids
        out = {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return JSONResponse(out)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, DetokenizeRequest, cfg.max_body_bytes)
        check_model(body.model, cfg)
        vocab = state.renderer.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": state.renderer.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    return router
