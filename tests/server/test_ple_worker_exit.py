"""`revolta serve --ple-placement disk` when its PLE worker process dies mid-request (issue 22, spec/engine.md §6.4):
the streaming client gets an error naming the worker within the bound, /health turns 503, and the server exits
with status 3 (EXIT_ENGINE_FAILED) instead of hanging or serving a broken engine. (The alternative, restarting
the worker, is not what revolta does: a worker that dies once usually dies again, e.g. on a memory limit.)"""

from __future__ import annotations

import re
import time

import httpx

from revolta.server.app import EXIT_ENGINE_FAILED

from .conftest import MODEL, kill_mid_stream, run_server

BOUND_S = 10.0


def _worker_pid(server) -> int:
    deadline = time.monotonic() + 30
    while not (m := re.search(r"PLE worker process pid (\d+)", server.log())):
        assert time.monotonic() < deadline, "no PLE worker in the server log:\n" + server.log()[-3000:]
        time.sleep(0.1)
    return int(m[1])


def test_a_dead_ple_worker_fails_the_stream_turns_health_503_and_exits_3():
    with run_server("--ple-placement", "disk", "--sse-keep-alive-interval", "0") as s:
        pid = _worker_pid(s)
        error, failed_after = kill_mid_stream(s, pid)
        assert error is not None and "PLE worker process" in error["message"] and "SIGKILL" in error["message"]
        assert failed_after < BOUND_S, failed_after
        assert httpx.get(s.url + "/health").status_code == 503  # answered for FATAL_EXIT_DELAY_S before exiting
        assert s.proc.wait(timeout=BOUND_S + 10) == EXIT_ENGINE_FAILED
        assert "revolta serve exits: the engine stopped" in s.log()
