"""build_app: the FastAPI application around one LLM; run_server: `revolta serve`."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from .anthropic_messages import anthropic_router
from .basic_routes import basic_router
from .chat_prompt import PromptRenderer
from .config import ServerConfig
from .dev_routes import dev_router
from .engine_loop import EngineLoop
from .errors import install_error_handlers
from .generation import ServerState
from .media_budget import MediaBudget, MediaReleaseMiddleware, resolve_budget
from .metrics import Metrics
from .middleware import ServerMiddleware
from .openai_chat import chat_router
from .openai_completions import completions_router
from .openai_responses import responses_router

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3  # `revolta serve`'s status when the engine stopped on a fatal error (e.g. the PLE worker died)
FATAL_EXIT_DELAY_S = 2.0  # /health answers 503 this long before the server shuts down


def build_app(llm: Any, config: ServerConfig, fault_injection: bool = False,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The server app for `llm` (an `revolta.LLM`); its engine thread runs while the app is up.
    on_fatal: called (on the engine thread) once the engine has stopped on a FatalEngineError."""
    if llm.get_tokenizer() is None:
        raise ValueError(f"{config.model_path} has no tokenizer.json; the server needs one to render prompts")
    metrics = Metrics(config.served_model_name)
    engine = EngineLoop(llm, on_output=metrics.on_output, on_finish=metrics.on_finish, on_fatal=on_fatal)
    capacity, source = resolve_budget(config.max_media_memory_gib)
    media = MediaBudget(capacity, config.media_wait_timeout_s, source)
    state = ServerState(llm=llm, engine=engine, config=config, renderer=PromptRenderer(llm, config, media),
                        metrics=metrics, defaults=llm.get_default_sampling_params(), fault_injection=fault_injection)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("revolta server ready: %s", {**config.describe(), **media.describe()})
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="revolta", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    for router in (basic_router, chat_router, completions_router, responses_router, anthropic_router):
        app.include_router(router(state))
    if config.enable_dev_endpoints:  # /sleep, /wake_up, /pause, ... (off by default: those paths are 404)
        app.include_router(dev_router(state))
    app.add_middleware(ServerMiddleware, api_key=config.api_key)
    app.add_middleware(MediaReleaseMiddleware)  # every media hold goes back when its request's exchange ends
    app.state.revolta = state
    return app


def run_server(llm: Any, config: ServerConfig, host: str, port: int, fault_injection: bool = False,
               log_level: str = "info", sock: socket.socket | None = None) -> int:
    """Serve until stopped; returns 0, or EXIT_ENGINE_FAILED when the engine stopped on a FatalEngineError
    (the server keeps answering, /health 503, for FATAL_EXIT_DELAY_S, then shuts down). sock: host:port already
    bound (`revolta serve` binds it before the model loads), listened on and closed here; None: uvicorn binds it."""
    import uvicorn

    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:
        fatal.append(error)
        threading.Timer(FATAL_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    app = build_app(llm, config, fault_injection, on_fatal=on_fatal)
    # http="h11"/"httptools" both advertise ASGI 2.3, so Starlette watches for disconnects while streaming
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        if sock is not None:
            sock.close()
        close = getattr(llm, "close", None)
        if close is not None:
            close()  # the engine thread has stopped: end its worker processes (tensor-parallel ranks), bounded
    if fatal:
        logger.error("revolta serve exits: the engine stopped (%s)", fatal[0])
        return EXIT_ENGINE_FAILED
    return 0
