"""Issue 7's "no client error produces a 5xx", as a property over the real server: hypothesis mutates valid bodies
of every JSON route (a field dropped, replaced by an arbitrary JSON value, an unknown field added, a message or
content part replaced, the body not an object or not JSON at all) and every answer must be a 2xx or a 4xx in the
route's own error envelope (Anthropic's on /v1/messages*, OpenAI's elsewhere). Afterwards the server is healthy,
nothing is left running and the KV cache is back to where it started."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
# valid bodies; the generation limits are never dropped or nulled (either is valid and decodes up to max_model_len),
# any other value can replace them
BASE: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "/v1/chat/completions": ({"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0,
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {"x": {"type": "integer"}}}}}]},
                             ("max_tokens",)),
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}, ("max_tokens",)),
    "/v1/responses": ({"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0},
                      ("max_output_tokens",)),
    "/v1/messages": ({"model": MODEL, "messages": USER, "max_tokens": 2}, ("max_tokens",)),
    "/v1/messages/count_tokens": ({"model": MODEL, "messages": USER}, ()),
    "/tokenize": ({"model": MODEL, "prompt": "hi"}, ()),
    "/detokenize": ({"model": MODEL, "tokens": [1, 2]}, ()),
}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")

# JSON values with the edges that break naive validation: huge and negative numbers, empty and long strings,
# nesting; a valid small integer stays possible (so some mutations are valid requests)
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 2**31, 2**63, 10**30]),
                    st.sampled_from([-1.5, 0.0, 0.5, 1e308, -1e308]),
                    st.text(max_size=8), st.sampled_from(["", "x" * 5000, "user", "assistant", "image_url",
                                                          "data:image/png;base64,AAAA", "\x00", "</think>"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3),
                                                       st.fixed_dictionaries({"type": st.text(max_size=10)})),
                      max_leaves=6)
parts = st.one_of(values, st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "image", "video_url",
                                                                          "input_audio", "tool_use", "tool_result",
                                                                          "nope"])}, optional={
    "text": values, "image_url": values, "source": values, "id": values, "content": values, "input": values}))
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system",
                                                                                 "tool", "developer"]), values)},
                                          optional={"content": st.one_of(values, st.lists(parts, max_size=3)),
                                                    "tool_calls": values, "name": values}), max_size=3)


@st.composite
def mutated(draw) -> tuple[str, bytes, str]:
    route = draw(st.sampled_from(sorted(BASE)))
    base, keep = BASE[route]
    body: Any = json.loads(json.dumps(base))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add", "messages", "whole", "raw"]))
    if kind == "replace":
        name = draw(st.sampled_from(sorted(body)))
        # null is a valid generation limit too (up to max_model_len): not a bad input, just a slow one
        body[name] = draw(values.filter(lambda v: v is not None) if name in keep else values)
    elif kind == "drop":
        names = sorted(k for k in body if k not in keep)
        if names:
            del body[draw(st.sampled_from(names))]
    elif kind == "add":
        body[draw(st.sampled_from(["n", "stop", "logprobs", "top_logprobs", "response_format", "tool_choice",
                                   "seed", "stream_options", "thinking", "system", "stop_sequences", "top_k",
                                   "logit_bias", "reasoning", "text", "structured_outputs", "extra_field"]))] = \
            draw(values)
    elif kind == "messages" and "messages" in body:
        body["messages"] = draw(messages)
    elif kind == "whole":
        body = draw(values)
    if kind == "raw":
        return route, draw(st.sampled_from([b"", b"{", b"[1,", b"\xff\xfe", b"null", b'{"model": NaN}'])), kind
    return route, json.dumps(body).encode(), kind


def _envelope_ok(route: str, status: int, payload: Any) -> bool:
    if route in ANTHROPIC:
        return (isinstance(payload, dict) and payload.get("type") == "error"
                and isinstance(payload.get("error"), dict) and isinstance(payload["error"].get("message"), str)
                and payload["error"].get("type") in ("invalid_request_error", "not_found_error", "request_too_large"))
    err = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("code") == status


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@settings(max_examples=int(os.environ.get("REVOLTA_FUZZ_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=mutated())
# the 500s it found, kept as regressions: an undeclared extra reaching the sampling code untyped, and a
# response_format that is not an object on /v1/completions
@example(case=("/v1/responses", json.dumps({**BASE["/v1/responses"][0], "stop": True}).encode(), "add"))
@example(case=("/v1/completions", json.dumps({**BASE["/v1/completions"][0], "response_format": True}).encode(), "add"))
def test_no_client_error_is_a_5xx(http, case):
    route, raw, kind = case
    r = http.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, kind, raw[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert _envelope_ok(route, r.status_code, r.json()), (route, raw[:300], r.status_code, r.text[:300])


def test_server_is_unharmed_after_the_fuzzing(server, http):
    """Runs after the property above (file order)."""
    deadline = time.monotonic() + 5
    while server.metric("vllm:num_requests_running") or server.metric("vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "requests left running after the fuzzing"
        time.sleep(0.1)
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json=BASE["/v1/chat/completions"][0])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
