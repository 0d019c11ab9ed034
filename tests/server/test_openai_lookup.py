"""GET /v1/models/{id}, HEAD on the probe routes, GET / DELETE /v1/responses/{id}, and the 400 for a tool schema
a forced tool_choice cannot enforce: the real server app under uvicorn with the official SDKs, on the scripted
engine (scripted_llm.py; nothing here needs real weights)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .conftest import openai_client

M = "scripted"  # the conftest `scripted` server's name
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def oc(scripted):
    return openai_client(scripted[1])


def test_model_retrieve(scripted, oc):
    m = oc.models.retrieve(M)
    assert (m.id, m.object, m.owned_by) == (M, "model", "revolta")
    assert m.model_dump() == oc.models.list().data[0].model_dump()  # the card the list shows
    with pytest.raises(openai.NotFoundError, match="`other` does not exist"):
        oc.models.retrieve("other")
    r = httpx.get(scripted[1] + "/v1/models/org/other")  # a name with a slash reaches the route, not a 404 route miss
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == 404


@pytest.mark.parametrize("path", ["/health", "/ping", "/v1/models", f"/v1/models/{M}"])
def test_probe_routes_answer_head(scripted, path):
    get, head = httpx.get(scripted[1] + path), httpx.head(scripted[1] + path)
    assert get.status_code == head.status_code == 200 and head.content == b""
    assert head.headers.get("content-length") == get.headers.get("content-length")


def test_responses_retrieve_and_delete(scripted, oc, say, monkeypatch):
    say("Hello there.", "Streamed answer.", "one", "two", "three", "not kept")
    ask = {"model": M, "input": "hi", "max_output_tokens": 16, "extra_body": NO_THINK}
    made = oc.responses.create(**ask)
    assert made.output_text == "Hello there."
    assert oc.responses.retrieve(made.id).model_dump() == made.model_dump()
    events = list(oc.responses.create(**ask, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed" and oc.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert oc.responses.retrieve(final.id).output_text == "Streamed answer."

    from revolta.server import openai_responses
    monkeypatch.setattr(openai_responses, "MAX_STORED", 2)  # the store's bound, the one previous_response_id uses
    ids = [oc.responses.create(**ask).id for _ in range(3)]
    for gone in (made.id, final.id, ids[0]):  # the oldest went out
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{gone}' not found"):
            oc.responses.retrieve(gone)
    assert [oc.responses.retrieve(i).id for i in ids[1:]] == ids[1:]

    assert oc.responses.delete(ids[1]) is None  # the SDK reads no body; the raw answer is OpenAI's
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(**ask, previous_response_id=ids[1])
    r = httpx.delete(f"{scripted[1]}/v1/responses/{ids[2]}")
    assert r.json() == {"id": ids[2], "object": "response", "deleted": True}
    assert httpx.delete(f"{scripted[1]}/v1/responses/{ids[2]}").status_code == 404

    unstored = oc.responses.create(**ask, store=False)
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(unstored.id)


BOGUS = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"type": "bogus"}}, "required": ["x"]}}}
FINE = {"type": "function", "function": {"name": "fine", "parameters": {"type": "object", "properties": {}}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "broken"}}])
def test_forced_tool_choice_with_an_uncompilable_schema_is_400(scripted, oc, choice):
    with pytest.raises(openai.BadRequestError, match=r"tool 'broken'.*bogus") as e:
        oc.chat.completions.create(model=M, messages=HI, tools=[FINE, BOGUS], tool_choice=choice, max_tokens=8)
    assert e.value.body["param"] == "tools"
    ac = anthropic.Anthropic(base_url=scripted[1], api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tool 'broken'"):
        ac.messages.create(model=M, max_tokens=8, messages=HI, tool_choice={"type": "any"},
                           tools=[{"name": "broken", "input_schema": BOGUS["function"]["parameters"]}])


def test_auto_tool_choice_with_an_uncompilable_schema_still_runs(scripted, oc, say):
    say("plain answer")
    r = oc.chat.completions.create(model=M, messages=HI, tools=[BOGUS], tool_choice="auto", max_tokens=8,
                                   extra_body=NO_THINK)
    assert r.choices[0].message.content == "plain answer"
    # a forced call of another (compilable) tool is not refused for the broken one's schema
    say("</function>\n</tool_call>")  # after the prompt's forced opening
    r = oc.chat.completions.create(model=M, messages=HI, tools=[FINE, BOGUS], max_tokens=32, extra_body=NO_THINK,
                                   tool_choice={"type": "function", "function": {"name": "fine"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["fine"]
    assert scripted[0].sampling_params[-1].structured_outputs is not None  # its call's grammar is enforced
