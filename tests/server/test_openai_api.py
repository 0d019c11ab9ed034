"""Black-box checks of spec/server.md §7 A, B, E, F on the OpenAI routes, with the openai SDK and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import MAX_MODEL_LEN, MODEL, sse_lines

HI = [{"role": "user", "content": "Say hi"}]
# The random-weight model never closes its <think> block, so checks on `content` turn thinking off.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def data_events(response: httpx.Response) -> list:
    out = []
    for line in sse_lines(response):
        assert line.startswith("data: "), line
        out.append(line[6:])
    return out


def long_prompt(server, extra: int = 10) -> str:
    """A text prompt of max_model_len + `extra` tokens or more, sized with /tokenize."""
    text = "hello " * (MAX_MODEL_LEN + extra)
    assert httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"] >= MAX_MODEL_LEN + extra
    return text


def assert_still_serving(oc) -> None:
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- A. discovery and health ------------------------------------------------------------------
def test_health_models_metrics(server, oc):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/version").json()["version"]
    models = oc.models.list().data
    assert [(m.id, m.object) for m in models] == [(MODEL, "model")]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in m.text


def test_metrics_count_speculative_rounds(server, oc):
    # the embedded default has an MTP layer, so the server drafts with MTP4 by default
    oc.completions.create(model=MODEL, prompt="one two three", max_tokens=6, temperature=0)

    def counter(text, name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    text = httpx.get(server.url + "/metrics").text
    rounds = counter(text, "vllm:spec_decode_num_drafts_total")
    drafted = counter(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert rounds >= 1 and drafted >= rounds and 0 <= accepted <= drafted
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text


def test_tokenize_detokenize_and_chat_prompt_count(server, oc):
    t = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()
    assert set(t) == {"count", "max_model_len", "tokens"} and t["count"] == len(t["tokens"]) > 0
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "hello"}
    counted = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()["count"]
    usage = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).usage
    assert counted == usage.prompt_tokens


# ---- B. chat completions ----------------------------------------------------------------------
def test_chat_basic(oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 6


def test_chat_stream_shapes_and_usage_match_non_stream(server, oc):
    req = {"model": MODEL, "messages": HI, "max_tokens": 6, "temperature": 0}
    plain = oc.chat.completions.create(**req, extra_body=NO_THINK)
    assert plain.choices[0].message.content
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**req, **NO_THINK, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        events = data_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == [plain.choices[0].finish_reason]
    usage = {k: chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert chunks[-1]["choices"] == [] and usage == plain.usage.model_dump(include=set(usage))
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == plain.choices[0].message.content
    # the SDK's own stream parser agrees
    got = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(
        **req, stream=True, extra_body=NO_THINK) if c.choices)
    assert got == text


def test_determinism_greedy_and_seeded(oc):
    greedy = [oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, extra_body=NO_THINK)
              .choices[0].message.content for _ in range(2)]
    seeded = [oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0.8, seed=123,
                                         extra_body=NO_THINK).choices[0].message.content for _ in range(2)]
    assert greedy[0] and seeded[0] and greedy[0] == greedy[1] and seeded[0] == seeded[1]


def test_reasoning_split(server, oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    m = r.choices[0].message
    assert m.reasoning and m.model_extra["reasoning_content"] == m.reasoning  # thinking is on by default
    assert "<think>" not in m.reasoning and "</think>" not in (m.content or "")
    off = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, extra_body=NO_THINK)
    assert not off.choices[0].message.model_extra.get("reasoning") and off.choices[0].message.content
    chunks = list(oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices)
    assert streamed == m.reasoning
    hidden = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0,
                                        extra_body={"include_reasoning": False})
    assert not hidden.choices[0].message.model_extra.get("reasoning")


def test_n_choices(oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, n=2, temperature=0.8, seed=1,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8  # summed over the choices
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, n=2, temperature=0)
    assert e.value.param == "n"


def test_logprobs(oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    for bad in ({"top_logprobs": 5}, {"logprobs": True, "top_logprobs": 1000}):
        with pytest.raises(openai.BadRequestError):
            oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, **bad)


def test_max_completion_tokens_wins(oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=50, max_completion_tokens=3,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stop_string(oc):
    req = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "extra_body": NO_THINK}
    full = oc.chat.completions.create(**req).choices[0].message.content
    stop = full[len(full) // 2]
    r = oc.chat.completions.create(**req, stop=[stop])
    c = r.choices[0]
    assert c.message.content == full[:full.index(stop)] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop


def test_unknown_fields_are_ignored(server, oc):
    r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, user="u", metadata={"a": "b"},
                                   extra_body={"foo": 1, "top_k": 5, "min_p": 0.1})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "bar": [1]})
    assert r.status_code == 200  # an omitted model selects the served one


# ---- E. responses and completions -------------------------------------------------------------
def test_responses(server, oc):
    r = oc.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.usage.input_tokens > 0
    msg = [o for o in r.output if o.type == "message"]
    assert msg and msg[0].content[0].type == "output_text"
    follow = oc.responses.create(model=MODEL, input="more", max_output_tokens=2, previous_response_id=r.id)
    assert follow.usage.input_tokens > r.usage.input_tokens  # the stored turn is part of the prompt
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id="resp_nope")
    events = list(oc.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True, extra_body=NO_THINK))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output[0].content[0].text == text
    thinking = [e.type for e in oc.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True)]
    assert thinking.index("response.reasoning_text.delta") < thinking.index("response.reasoning_text.done") < \
        thinking.index("response.content_part.added")  # the reasoning item, then the (empty) message
    with httpx.stream("POST", server.url + "/v1/responses",
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True}) as raw:
        lines = sse_lines(raw)
    assert "data: [DONE]" not in lines and all(line.startswith(("event: ", "data: ")) for line in lines)


def block_size(server) -> int:
    line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines()
                if x.startswith("vllm:cache_config_info{"))
    return int(line.split('block_size="')[1].split('"')[0])


def test_responses_cached_tokens_come_from_the_prefix_cache(server, oc):
    text = "a prompt of its own " + "word " * 900
    first = oc.responses.create(model=MODEL, input=text, max_output_tokens=1)
    second = oc.responses.create(model=MODEL, input=text, max_output_tokens=1)
    assert first.usage.input_tokens_details.cached_tokens == 0
    prompt, cached, bs = second.usage.input_tokens, second.usage.input_tokens_details.cached_tokens, block_size(server)
    # whole blocks up to the last boundary before the final prompt token (where the hybrid cache snapshots)
    assert prompt == first.usage.input_tokens and 0 < cached < prompt and cached % bs == 0
    assert cached == (prompt - 1) // bs * bs
    events = list(oc.responses.create(model=MODEL, input=text, max_output_tokens=1, stream=True))
    assert events[-1].response.usage.input_tokens_details.cached_tokens == cached


def test_responses_output_text_logprobs(server, oc):
    """include=["message.output_text.logprobs"] + top_logprobs: the chat route's logprobs for the same greedy answer
    (the same prompt), in the SDK's types, non-stream and stream; without include, none."""
    kw = {"model": MODEL, "input": HI[0]["content"], "max_output_tokens": 5, "temperature": 0, "top_logprobs": 3,
          "include": ["message.output_text.logprobs"], "extra_body": NO_THINK}
    r = oc.responses.create(**kw)
    [part] = [p for item in r.output if item.type == "message" for p in item.content]
    lps = part.logprobs
    assert lps is not None and len(lps) == r.usage.output_tokens
    chat = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body=NO_THINK).choices[0].logprobs.content
    assert [(x.token, x.bytes) for x in lps] == [(x.token, x.bytes) for x in chat]
    for mine, theirs in zip(lps, chat):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4) and len(mine.top_logprobs) == 3
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert mine.top_logprobs[0].logprob == pytest.approx(mine.logprob, abs=1e-6)  # greedy: the top token
    events = list(oc.responses.create(**kw, stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = [p for item in events[-1].response.output if item.type == "message" for p in item.content][0]
    assert [x.token for x in done.logprobs] == [x.token for x in final.logprobs] == [x.token for x in lps]
    assert [x.token for x in deltas] == [x.token for x in lps][:len(deltas)] and deltas  # tokens that made text
    assert all(len(x.top_logprobs) == 3 for x in deltas)
    plain = oc.responses.create(**{k: v for k, v in kw.items() if k != "include"})
    assert [p.logprobs for item in plain.output if item.type == "message" for p in item.content] == [[]]
    with pytest.raises(openai.BadRequestError):
        oc.responses.create(**{**kw, "top_logprobs": 50})


def test_completions(server, oc):
    r = oc.completions.create(model=MODEL, prompt="1,2,3,", max_tokens=4)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    default = oc.completions.create(model=MODEL, prompt="1,2,3,", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the legacy default max_tokens
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "1,2,3,"}).json()["tokens"]
    by_ids = oc.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = oc.completions.create(model=MODEL, prompt="1,2,3,", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "1,2,3,", "max_tokens": 3, "temperature": 0,
                            "stream": True}) as raw:
        events = data_events(raw)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == by_text.choices[0].text


def test_completions_echo_scores_the_prompt(server, oc):
    """lm-eval's loglikelihood calls: echo + logprobs with max_tokens 0 gives the prompt back with a logprob per
    prompt token (the first null); with max_tokens > 0 the generated tokens' logprobs follow. The logprobs of a
    prompt position are the distribution a generation from the prefix before it sees (streamed: the same)."""
    prompt = "The quick brown fox jumps"  # the trained default gives " brown" probability 0: floored, still JSON
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    scored = oc.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    [c] = scored.choices
    lp = c.logprobs
    assert c.text == prompt and c.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(3 <= len(t) <= 4 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    k = len(ids) - 1  # the distribution over the last prompt token = the first generated one's after ids[:k]
    step = oc.completions.create(model=MODEL, prompt=ids[:k], echo=True, logprobs=3, max_tokens=1, temperature=0)
    gen = step.choices[0].logprobs
    assert len(gen.tokens) == k + 1 and gen.token_logprobs[:k] == pytest.approx(lp.token_logprobs[:k], abs=1e-3)
    assert step.choices[0].text == "".join(gen.tokens) and gen.text_offset[k] == len("".join(gen.tokens[:k]))
    best = max(gen.top_logprobs[k], key=gen.top_logprobs[k].get)
    assert best in lp.top_logprobs[k] and lp.top_logprobs[k][best] == pytest.approx(gen.top_logprobs[k][best], abs=1e-3)
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0, "stream": True}) as raw:
        events = data_events(raw)
    assert events[-1] == "[DONE]" and len(events) == 2
    [chunk] = json.loads(events[0])["choices"]
    assert chunk["text"] == prompt and chunk["finish_reason"] == "length"
    assert chunk["logprobs"]["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-3)
    streamed = list(oc.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                          temperature=0, stream=True))
    plain = oc.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert "".join(x.choices[0].text for x in streamed) == plain.choices[0].text
    assert [t for x in streamed for t in x.choices[0].logprobs.tokens] == plain.choices[0].logprobs.tokens
    assert len(plain.choices[0].logprobs.tokens) == len(ids) + plain.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens") as e:
        oc.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # without echo, as vLLM
    assert e.value.body["param"] == "max_tokens"


# ---- F. bad input -----------------------------------------------------------------------------
def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and isinstance(body["error"]["message"], str)
    return body["error"]


def test_malformed_body_and_content_type(server, oc):
    url = server.url + "/v1/chat/completions"
    assert_openai_error(httpx.post(url, content='{"model":', headers={"content-type": "application/json"}), 400)
    assert_openai_error(httpx.post(url, content=json.dumps({"messages": HI}),
                                   headers={"content-type": "text/plain"}), 400)
    assert_openai_error(httpx.post(url, json={"messages": "x"}), 400)
    assert_openai_error(httpx.post(url, json=[1, 2]), 400)
    assert_openai_error(httpx.post(server.url + "/v1/nope", json={}), 404)
    assert_still_serving(oc)


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_unknown_model(oc, route):
    call = {"chat": lambda: oc.chat.completions.create(model="nope", messages=HI, max_tokens=1),
            "completions": lambda: oc.completions.create(model="nope", prompt="x", max_tokens=1),
            "responses": lambda: oc.responses.create(model="nope", input="x", max_output_tokens=1)}[route]
    with pytest.raises(openai.NotFoundError) as e:
        call()
    assert e.value.status_code == 404 and e.value.param == "model"
    assert_still_serving(oc)


@pytest.mark.parametrize("stream", [False, True])
def test_too_long_prompt_is_400_on_every_route(server, oc, stream):
    text = long_prompt(server)
    before = server.metric("vllm:prompt_tokens_total")
    calls = [lambda: oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=1, stream=stream),
             lambda: oc.completions.create(model=MODEL, prompt=text, max_tokens=1, stream=stream),
             lambda: oc.responses.create(model=MODEL, input=text, max_output_tokens=1, stream=stream)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "maximum context length" in e.value.message
    assert server.metric("vllm:prompt_tokens_total") == before  # rejected before prefill
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=MAX_MODEL_LEN + 1)
    assert_still_serving(oc)


@pytest.mark.parametrize("field,value", [("max_tokens", -5), ("max_tokens", 0), ("temperature", 3), ("top_p", 0),
                                         ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 5),
                                         ("stop", ["a", "b", "c", "d", "e"])])
def test_out_of_range_sampling(server, oc, field, value):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                                              field: value})
    assert assert_openai_error(r, 400)["param"] == field
    assert_still_serving(oc)


def test_logit_bias_is_applied_and_checked(server, oc):
    """logit_bias was accepted and silently ignored, bad keys included (vLLM applies it and 400s bad ids)."""
    [hello] = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    for route in ("chat", "completions"):
        if route == "chat":
            r = oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, extra_body=NO_THINK,
                                           logit_bias={str(hello): 100})
            text = r.choices[0].message.content
        else:
            r = oc.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logit_bias={str(hello): 100})
            text = r.choices[0].text
        assert text == "hello" * 4 and r.usage.completion_tokens == 4
    for bias in ({"abc": 1}, {"99999999": 1}, {"-1": 1}, {str(hello): "x"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logit_bias": bias})
        assert assert_openai_error(r, 400)["param"] == "logit_bias", bias
    assert_still_serving(oc)


def test_stream_options_without_stream(server, oc):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": HI, "max_tokens": 1, "stream_options": {"include_usage": True}})
    assert assert_openai_error(r, 400)["param"] == "stream_options"
    assert_still_serving(oc)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"}},
    "required": ["city"]}}}


@pytest.mark.parametrize("extra", [
    {"tools": []},
    {"tools": [{"type": "function", "function": {"parameters": {}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "string"}}]},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
    {"tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "any"},
])
def test_invalid_tool_definitions(server, oc, extra):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                                              **extra})
    assert_openai_error(r, 400)
    assert_still_serving(oc)


def test_tool_history_with_malformed_arguments(oc):
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    r = oc.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_mid_stream_error(server, oc):
    headers = {"x-revolta-fail-after-tokens": "2"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=headers,
                      json={"model": MODEL, "messages": HI, "max_tokens": 8, "stream": True}) as r:
        events = data_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    with pytest.raises(openai.APIError) as e:
        for _ in oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, stream=True,
                                            extra_headers=headers):
            pass
    assert not isinstance(e.value, openai.APIStatusError)
    events = list(oc.responses.create(model=MODEL, input="hi", max_output_tokens=8, stream=True,
                                      extra_headers=headers))
    assert events[-1].type == "response.failed" and events[-1].response.error.message
    assert_still_serving(oc)  # the failure was that request's only
