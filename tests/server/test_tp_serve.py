"""`revolta serve -tp 2` on CPU (the embedded default split across 2 gloo ranks): the official openai SDK gets its
answers; a rank killed mid-stream fails the stream with an error naming the rank within a bound, /health turns 503
and the server exits with status 3, leaving no rank behind."""

from __future__ import annotations

import os
import re
import time

import httpx
import openai

from revolta.server.app import EXIT_ENGINE_FAILED

from .conftest import MODEL, kill_mid_stream, run_server

BOUND_S = 10.0
TP2 = ("-tp", "2", "--device", "cpu", "--sse-keep-alive-interval", "0")


def _worker_pid(server) -> int:
    m = re.search(r"tensor parallel: 2 ranks \(gloo\); worker pids \[(\d+)\]", server.log())
    assert m, "no worker pid in the server log:\n" + server.log()[-3000:]
    return int(m[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_tp2_answers_the_openai_sdk():
    with run_server(*TP2) as s:
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in oc.models.list().data] == [MODEL]
        r = oc.completions.create(model=MODEL, prompt="one two three", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8 and r.choices[0].text
        again = oc.completions.create(model=MODEL, prompt="one two three", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert again.choices[0].text == r.choices[0].text  # greedy, and the prefix cache hit gives the same
        chunks = list(oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "tensor_parallel_size   2" in s.log() or re.search(r"tensor_parallel_size\s+2\s", s.log())
        pid = _worker_pid(s)
        assert _alive(pid)
    deadline = time.monotonic() + BOUND_S  # run_server stopped the server (SIGTERM): the rank went with it
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_killed_rank_fails_the_stream_and_the_server_exits():
    with run_server(*TP2) as s:
        pid = _worker_pid(s)
        error, failed_after = kill_mid_stream(s, pid)
        assert error is not None and "revolta-tp-rank1 (exit code -9)" in error["message"], error
        assert failed_after < BOUND_S, failed_after
        assert httpx.get(s.url + "/health").status_code == 503
        assert s.proc.wait(timeout=BOUND_S + 10) == EXIT_ENGINE_FAILED
        assert "revolta serve exits: the engine stopped" in s.log()
