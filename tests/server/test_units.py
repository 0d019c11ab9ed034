"""Server pieces that need no engine: the status -> Anthropic type table, the keep-alive wrapper, limits."""

from __future__ import annotations

import asyncio

import pytest

from revolta.server.config import ServerConfig
from revolta.server.errors import anthropic_error_type
from revolta.server.sse import KEEP_ALIVE, merged, with_keep_alive


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                         (403, "permission_error"), (404, "not_found_error"),
                                         (413, "request_too_large"), (429, "rate_limit_error"),
                                         (503, "overloaded_error"), (500, "api_error"), (502, "api_error"),
                                         (422, "invalid_request_error"), (405, "invalid_request_error")])
def test_anthropic_error_type_from_status(status, kind):
    assert anthropic_error_type(status) == kind


def test_merged_interleaves_and_closes_every_source():
    """Frames as they come, each source's order kept; an error or an early exit closes the sources still open."""
    closed = []

    async def source(name, delays, fail=False):
        try:
            for k, delay in enumerate(delays):
                await asyncio.sleep(delay)
                yield f"{name}{k}"
            if fail:
                raise RuntimeError(f"{name} failed")
            await asyncio.sleep(10)  # still running when the merge ends
        finally:
            closed.append(name)

    async def run(fail: bool, take: int):
        got = []
        frames = merged([source("a", [0, 0.2]), source("b", [0.1, 0.2], fail=fail)])
        try:
            async for frame in frames:
                got.append(frame)
                if len(got) == take:
                    break
        except RuntimeError as e:
            got.append(str(e))
        await frames.aclose()
        return got

    assert asyncio.run(run(fail=True, take=99)) == ["a0", "b0", "a1", "b1", "b failed"]
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    assert asyncio.run(run(fail=False, take=2)) == ["a0", "b0"]
    assert sorted(closed) == ["a", "b"]


def test_keep_alive_fills_silence_and_closes_the_source():
    closed = []

    async def frames():
        try:
            yield "a"
            await asyncio.sleep(0.25)  # a silent stretch: several keep-alive intervals
            yield "b"
            await asyncio.sleep(10)
            yield "never"
        finally:
            closed.append(True)

    async def run():
        out = []
        agen = with_keep_alive(frames(), 0.05)
        async for frame in agen:
            out.append(frame)
            if frame == "b":
                break
        await agen.aclose()  # the client left: the source must be closed (its finally aborts the request)
        return out

    out = asyncio.run(run())
    assert out[0] == "a" and out[-1] == "b" and out.count(KEEP_ALIVE) >= 2 and set(out[1:-1]) == {KEEP_ALIVE}
    assert closed == [True]


def test_keep_alive_zero_is_pass_through():
    async def frames():
        await asyncio.sleep(0.1)
        yield "x"

    async def run():
        return [f async for f in with_keep_alive(frames(), 0)]

    assert asyncio.run(run()) == ["x"]


@pytest.mark.parametrize("kwargs,says", [({"sse_keep_alive_interval": -1}, "keep-alive"),
                                         ({"tool_call_parser": "hermes"}, "qwen3_coder")])
def test_server_config_rejects_bad_flags(kwargs, says):
    with pytest.raises(ValueError, match=says):
        ServerConfig(served_model_name="m", **kwargs)


def test_serve_cli_rejects_a_missing_model_dir(capsys):
    from revolta.cli import main

    assert main(["serve", "/nonexistent/checkpoint"]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [(["--limit-mm-per-prompt", '{"audio": 1}'], "no audio input"),
                                        (["--limit-mm-per-prompt", '{"image": -1}'], "image=-1"),
                                        (["--allowed-local-media-path", "/nonexistent/media"], "not a directory")])
def test_serve_cli_rejects_bad_media_flags_before_loading(capsys, flags, says):
    from revolta.cli import main

    assert main(["serve", *flags]) == 2
    assert says in capsys.readouterr().err


def test_sse_response_runs_on_close_even_if_the_body_never_starts():
    from revolta.server.sse import sse_response

    started, closed = [], []

    async def frames():
        started.append(True)
        yield "data: x\n\n"

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("client gone")  # fails at http.response.start, before the body is iterated

    async def run():
        response = sse_response(frames(), 0, lambda: closed.append(True))
        with pytest.raises(OSError):
            await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(run())
    assert closed == [True] and not started


def test_sse_response_holds_the_first_frame_until_ready():
    """With `ready` (RequestStream.started), only comments go out until it returns: the stream's opening frames wait
    for the engine's first output, as spec/server.md §7 H43 checks; the frames source starts afterwards."""
    from revolta.server.sse import sse_response

    events = []

    async def ready():
        await asyncio.sleep(0.3)  # a queue wait or a prefill
        events.append("ready")

    async def frames():
        events.append("frames started")
        yield "data: first\n\n"

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            events.append(message["body"].decode())

    async def run():
        response = sse_response(frames(), 0.05, lambda: events.append("closed"), ready=ready)
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(run())
    first = events.index("ready")
    assert first >= 3 and set(events[:first]) == {KEEP_ALIVE}
    assert events[first:] == ["ready", "frames started", "data: first\n\n", "closed"]


def test_sampling_fields_are_typed_whatever_the_route_declares():
    """build_sampling_params type-checks extras a route's body model does not declare (`stop` on /v1/responses
    was a 500), and leaves the ranges to SamplingParams: a thinking budget of 0 (close at once) is valid."""
    from pydantic import ValidationError

    from revolta.engine.sampling import SamplingParams
    from revolta.server.errors import APIError
    from revolta.server.params import build_sampling_params

    config, defaults = ServerConfig(served_model_name="m", max_model_len=64), SamplingParams()
    with pytest.raises(ValidationError, match="stop"):
        build_sampling_params({"stop": True}, defaults=defaults, config=config, max_tokens=2)
    assert build_sampling_params({"thinking_token_budget": 0}, defaults=defaults, config=config,
                                 max_tokens=2).thinking_token_budget == 0
    for bad in (-1, True, "4"):
        with pytest.raises(APIError, match="thinking_token_budget"):
            build_sampling_params({"thinking_token_budget": bad}, defaults=defaults, config=config, max_tokens=2)


def test_metrics_say_when_drafting_is_paused_and_why():
    from revolta.server.engine_loop import EngineStats
    from revolta.server.metrics import Metrics

    def value(text, name):
        return next(x for x in text.splitlines() if x.startswith(name + "{")).rsplit(" ", 1)[1]

    text = Metrics("m").render(EngineStats(speculative=True, spec_paused=True, spec_paused_steps=7, spec_speedup=0.25))
    assert value(text, "revolta:spec_decode_paused") == "1"
    assert value(text, "revolta:spec_decode_paused_steps_total") == "7"
    assert value(text, "revolta:spec_decode_estimated_speedup") == "0.2500"
    text = Metrics("m").render(EngineStats(speculative=True))
    assert value(text, "revolta:spec_decode_paused") == "0" and "estimated_speedup" not in text
    assert "revolta:spec_decode_paused" not in Metrics("m").render(EngineStats())


def test_n_and_seed_limits_are_400s_naming_the_field():
    """n=0 was served as n=1 (`n or 1`); a seed beyond int64 reached torch as "Overflow when unpacking long long"
    with no field named; n had no upper bound (each choice is a request in the engine). All are 400s naming the
    field, as vLLM's int64 seed bound and n >= 1 rule give, with OpenAI's n <= 128."""
    from revolta.engine.sampling import SamplingParams
    from revolta.server.errors import APIError
    from revolta.server.params import build_sampling_params

    config, defaults = ServerConfig(served_model_name="m", max_model_len=64), SamplingParams()
    for fields, param in (({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 10**9}, "n"), ({"seed": 2**64}, "seed"),
                          ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed")):
        with pytest.raises(APIError) as e:
            build_sampling_params({**fields, "temperature": 1.0}, defaults=defaults, config=config, max_tokens=2)
        assert e.value.status == 400 and e.value.param == param, (fields, e.value.message)
    for seed in (0, 2**63 - 1, -2**63):
        assert build_sampling_params({"seed": seed}, defaults=defaults, config=config, max_tokens=2).seed == seed
    most = build_sampling_params({"n": 128, "temperature": 1.0}, defaults=defaults, config=config, max_tokens=2)
    assert most.n == 128
    small = ServerConfig(served_model_name="m", max_model_len=64, max_n=2)
    with pytest.raises(APIError, match="n=3 is more than the 2 choices"):
        build_sampling_params({"n": 3, "temperature": 1.0}, defaults=defaults, config=small, max_tokens=2)


def test_reasoning_effort_must_be_one_of_openais_values():
    """A typo such as reasoning_effort="hgih" was served silently (OpenAI and vLLM answer 400 naming the field)."""
    from pydantic import ValidationError

    from revolta.server.protocol import ChatCompletionRequest, ResponsesRequest

    chat = {"messages": [{"role": "user", "content": "x"}]}
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", None):
        ChatCompletionRequest.model_validate({**chat, "reasoning_effort": effort})
        ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": effort, "summary": "auto"}})
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate({**chat, "reasoning_effort": "hgih"})
    with pytest.raises(ValidationError, match="reasoning.effort"):
        ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "hgih"}})


def test_legacy_logprobs_of_an_echoed_prompt_are_valid_json():
    """The first prompt token has no logprob (null, its text decoded); a token the model gives probability 0
    (-inf: the trained default does this for some prompt tokens) is floored at vLLM's -9999, not a 500."""
    import json
    import math

    from revolta.engine.request import Logprob
    from revolta.server.openai_completions import legacy_logprobs

    entries = [None, {7: Logprob(-math.inf, 900, "b"), 3: Logprob(-0.5, 1, "x")}, {8: Logprob(-1.0, 1, "cd")}]
    out = legacy_logprobs([5, 7, 8], entries, 10, lambda i: f"<{i}>")
    assert out == {"tokens": ["<5>", "b", "cd"], "token_logprobs": [None, -9999.0, -1.0],
                   "top_logprobs": [None, {"x": -0.5, "b": -9999.0}, {"cd": -1.0}], "text_offset": [10, 13, 14]}
    json.dumps(out, allow_nan=False)


def test_further_served_model_names_are_aliases():
    """vLLM's `--served-model-name qwen flash`: requests may name either; an unknown name's 404 lists both."""
    from revolta.server.errors import APIError
    from revolta.server.params import check_model

    config = ServerConfig(served_model_name="qwen", served_model_aliases=("flash",))
    check_model("flash", config)
    check_model("qwen", config)
    with pytest.raises(APIError) as e:
        check_model("other", config)
    assert e.value.status == 404 and "qwen, flash" in str(e.value)
