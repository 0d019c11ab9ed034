"""vLLM's development endpoints, only with --enable-dev-endpoints (otherwise these paths are 404):

    POST /sleep?level=1&mode=abort     level 0, 1 or 2 (LLM.sleep); mode abort | wait for requests in flight
    POST /wake_up                      LLM.wake_up
    GET  /is_sleeping                  {"is_sleeping": bool}
    POST /pause?wait_for_inflight_requests=false&clear_cache=true   (or mode=abort | wait | keep)
    POST /resume
    GET  /is_paused                    {"is_paused": bool}

Each runs on the engine thread between two steps (EngineLoop.call). Requests aborted by a sleep or pause
end with finish_reason "abort"; drained ones stream to their end. While the engine sleeps, new requests
get 503 with Retry-After (refused at once, not held: a sleep frees the GPU for something else and can
last long); while it is paused they are accepted and wait for /resume, as in vLLM. A sleep whose preflight
fails (host memory short) answers 507 and the engine keeps serving.
"""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ..engine.sleep import SleepRefused
from .engine_loop import RequestFailed
from .errors import APIError, bad_request
from .generation import ServerState


def dev_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    llm, engine = state.llm, state.engine

    @router.post("/sleep")
    async def sleep(level: int = Query(1), mode: str = Query("abort")) -> JSONResponse:
        try:
            await engine.call(lambda: llm.sleep(level=level, mode=mode, on_outputs=engine.deliver))
        except SleepRefused as e:
            raise APIError(507, str(e)) from None
        except ValueError as e:
            raise bad_request(str(e), "level") from None
        except RequestFailed as e:
            raise APIError(e.status, str(e)) from None
        return JSONResponse({"status": "sleeping", "level": level})

    @router.post("/wake_up")
    async def wake_up() -> JSONResponse:
        await engine.call(llm.wake_up)
        return JSONResponse({"status": "awake"})

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": llm.is_sleeping()})  # a flag: read now, not after the running step

    @router.post("/pause")
    async def pause(wait_for_inflight_requests: bool = Query(False), clear_cache: bool = Query(True),
                    mode: str | None = Query(None)) -> JSONResponse:
        mode = mode or ("wait" if wait_for_inflight_requests else "abort")
        try:
            await engine.call(lambda: llm.pause(mode=mode, clear_cache=clear_cache, on_outputs=engine.deliver))
        except ValueError as e:
            raise bad_request(str(e), "mode") from None
        except RequestFailed as e:
            raise APIError(e.status, str(e)) from None
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume() -> JSONResponse:
        await engine.call(llm.resume)
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": llm.is_paused()})

    return router
