"""Structured outputs and thinking budgets (structured.py): the bitmask and matcher steps on a tiny
vocabulary, then the whole path through `LLM` on the embedded default (random weights: only the
constraint makes the output valid), with speculative decoding on (the default MTP4) and off."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

import pytest
import torch

import xgrammar  # noqa: E402,F401  (a test dependency: fail, do not skip, when CI lacks it)

from revolta import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from revolta.engine.structured import (RequestConstraint, StructuredDecoding, StructuredOutputError,  # noqa: E402
                                       compact_json_default, prompt_opens_reasoning, unpack_bitmask)
from revolta.tokenizer import bytes_to_symbols  # noqa: E402

OFF = {"method": None}


# ---- a tiny vocabulary --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Added:
    content: str
    special: bool


class TinyTokenizer:
    """What StructuredDecoding reads of a Tokenizer: byte-level BPE spellings plus added tokens."""

    WORDS = ["a", "b", "c", "ab", "1", "2", "{", "}", '"', ":", ",", " ", "true", "false"]
    ADDED = [("<|im_end|>", True), ("<think>", False), ("</think>", False)]

    def __init__(self):
        self.added_tokens = {len(self.WORDS) + i: _Added(t, s) for i, (t, s) in enumerate(self.ADDED)}

    @property
    def vocab_size(self) -> int:
        return len(self.WORDS) + len(self.ADDED)

    def id_to_token(self, i: int) -> str:
        return bytes_to_symbols(self.WORDS[i].encode())

    def token_to_id(self, text: str) -> int | None:
        if text in self.WORDS:
            return self.WORDS.index(text)
        return next((i for i, t in self.added_tokens.items() if t.content == text), None)


TINY = TinyTokenizer()
EOS, THINK, END = (TINY.token_to_id(t) for t in ("<|im_end|>", "<think>", "</think>"))
V = 40  # the model's rows: wider than the tokenizer (padding rows are never allowed)


def ids(*words: str) -> list[int]:
    return [TINY.token_to_id(w) for w in words]


def allowed_after(c: RequestConstraint, drafts=()) -> list[set[int]]:
    logits = torch.zeros(1 + len(drafts), V)
    c.mask_rows(logits, drafts)
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


@pytest.fixture()
def decoding():
    return StructuredDecoding(TINY, V, [EOS], cache_size=2)


def test_choice_mask_and_advance(decoding):
    c = RequestConstraint(decoding, StructuredOutputsParams(choice=["ab", "c"]), False, END, None)
    assert decoding.num_matchers == 1
    a, b, ab, cc = ids("a", "b", "ab", "c")
    [first] = allowed_after(c)
    assert first == {a, ab, cc}  # "ab" may come as one token or two
    assert c.accept(a) and allowed_after(c) == [{b}]
    assert c.accept(b) and allowed_after(c) == [{EOS}]
    assert not c.terminated and c.accept(EOS) and c.terminated
    c.close()
    c.close()  # closing twice releases once
    assert decoding.num_matchers == 0


def test_mask_rows_steps_through_drafts_and_rolls_back(decoding):
    c = RequestConstraint(decoding, StructuredOutputsParams(choice=["ab", "c"]), False, END, None)
    a, b, ab, cc = ids("a", "b", "ab", "c")
    rows = allowed_after(c, [a, b])
    assert rows == [{a, ab, cc}, {b}, {EOS}]  # row j as the grammar stands after drafts[:j]
    assert allowed_after(c) == [{a, ab, cc}]  # unchanged afterwards
    # a refused draft: its row is masked, the rows after it are never used and stay as they are
    rows = allowed_after(c, [b, a])
    assert rows[0] == {a, ab, cc} and rows[1] == rows[2] == set(range(V))
    assert allowed_after(c) == [{a, ab, cc}]


def test_grammar_waits_for_the_end_of_reasoning_and_budget_forces_it(decoding):
    c = RequestConstraint(decoding, StructuredOutputsParams(regex="1+2"), True, END, budget=2)
    one, two, a = ids("1", "2", "a")
    assert allowed_after(c) == [set(range(V))]  # reasoning is free text
    c.accept(a)
    rows = allowed_after(c, [a, a])  # the second reasoning token spends the budget: row 1 is forced
    assert rows[0] == set(range(V)) and rows[1] == {END}
    c.accept(a)
    assert allowed_after(c) == [{END}] and c.num_reasoning_tokens == 2
    c.accept(END)
    assert not c.in_reasoning and allowed_after(c) == [{one}]  # now the grammar applies
    assert allowed_after(c, [one, two]) == [{one}, {one, two}, {EOS}]
    # budget only: no matcher, the same forcing
    b = RequestConstraint(None, None, True, END, budget=0)
    assert not b.has_grammar and allowed_after(b) == [{END}]


def test_compiled_once_per_spec_and_the_cache_is_bounded(decoding):
    specs = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    decoding.compile(specs[0])
    decoding.compile(StructuredOutputsParams(regex="a+"))
    assert decoding.num_compiled == 1
    decoding.compile(specs[1])
    decoding.compile(specs[2])  # evicts a+ (cache_size=2)
    decoding.compile(specs[0])
    assert decoding.num_compiled == 4


def test_unpack_bitmask():
    words = torch.tensor([[0b101, -(1 << 31) | 1]], dtype=torch.int32)  # word 1: bits 0 and 31 (the sign bit)
    allowed = unpack_bitmask(words, 64)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 2, 32, 63]


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning([1, THINK, 5], THINK, END)
    assert not prompt_opens_reasoning([1, THINK, 5, END, 6], THINK, END)
    assert not prompt_opens_reasoning([1, 2], THINK, END) and not prompt_opens_reasoning([THINK], None, None)


@pytest.mark.parametrize("kwargs, says", [
    ({}, "none was set"),
    ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 3}, "must be a JSON schema object"),
    ({"choice": "ab"}, "non-empty list"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
    ({"json_object": False}, "none was set"),
])
def test_params_validation(kwargs, says):
    with pytest.raises(StructuredOutputError, match=says):
        StructuredOutputsParams(**kwargs)


def test_invalid_specs_name_the_field():
    with pytest.raises(StructuredOutputError, match=r"structured_outputs.json is invalid: .*foo") as e:
        StructuredOutputsParams(json={"type": "foo"}).check()
    assert e.value.param == "structured_outputs.json"
    with pytest.raises(StructuredOutputError, match="structured_outputs.grammar is invalid"):
        StructuredOutputsParams(grammar="root ::= undefined_rule").check()
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs == StructuredOutputsParams(regex="a")


def test_without_xgrammar_the_error_says_what_to_install(monkeypatch):
    from revolta.server.chat_prompt import tool_setup
    from revolta.server.tool_grammar import forced_call_constraint

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    with pytest.raises(StructuredOutputError, match=re.escape("pip install 'revolta[server]'")):
        StructuredOutputsParams(regex="a").check()
    with pytest.raises(StructuredOutputError, match="xgrammar"):
        StructuredDecoding(TINY, V, [EOS])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert forced_call_constraint(tool_setup([tool], "required")) is None  # the call's opening alone, as before


# ---- through LLM on the embedded default ----------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 3},
    },
    "required": ["count", "ok", "color"],
    "additionalProperties": False,
}


def check_schema(value, schema) -> None:
    """The part of JSON Schema that SCHEMA uses, checked by hand."""
    if "enum" in schema:
        assert value in schema["enum"], value
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema["required"]) <= set(value), value
        assert set(value) <= set(schema["properties"]), value
        for k, v in value.items():
            check_schema(v, schema["properties"][k])
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema["minimum"] <= value <= schema["maximum"], value
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema["maxLength"], value


@pytest.fixture(scope="module")
def spec(default_dir):
    llm = LLM(model=str(default_dir))  # the default: MTP4
    assert llm.speculative_config.enabled
    return llm


@pytest.fixture(scope="module")
def plain(default_dir):
    return LLM(model=str(default_dir), speculative_config=OFF)


def replace_drafts(llm, drafts_for):
    """The MTP head still runs, but its drafts become drafts_for(all_token_ids, k); returns the undo."""
    propose = llm.engine.drafter.propose

    def forced(items):
        out = propose(items)
        for it, d in zip(items, out):
            d[:] = drafts_for(it.all_token_ids, it.num_drafts)[:it.num_drafts]
        return out

    llm.engine.drafter.propose = forced
    return lambda: setattr(llm.engine.drafter, "propose", propose)


# random weights write whitespace forever where JSON allows it: compact separators keep outputs short
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
# fewer tokens for the slower speculative runs on CPU
SMALL_SCHEMA = {**SCHEMA, "properties": {k: SCHEMA["properties"][k] for k in ("ok", "color")},
                "required": ["ok", "color"]}
SMALL = StructuredOutputsParams(json=SMALL_SCHEMA, disable_any_whitespace=True)


def test_json_schema_regex_and_choice(plain):
    specs = [JSON, StructuredOutputsParams(regex=r"[a-c]{2}-\d"), StructuredOutputsParams(choice=["yes", "no"])]
    params = [SamplingParams(temperature=t, seed=7, max_tokens=48, structured_outputs=so)
              for so in specs for t in (0.0, 1.0)]
    outs = [o.outputs[0] for o in plain.generate(["Reply in JSON."] * len(params), params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    for o in outs[:2]:
        check_schema(json.loads(o.text), SCHEMA)
    assert all(re.fullmatch(r"[a-c]{2}-\d", o.text) for o in outs[2:4]), [o.text for o in outs[2:4]]
    assert all(o.text in ("yes", "no") for o in outs[4:]), [o.text for o in outs[4:]]
    unconstrained = plain.generate("Reply in JSON.", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    with pytest.raises(json.JSONDecodeError):  # without the constraint the random model writes no JSON
        json.loads(unconstrained[0].outputs[0].text)
    assert plain.structured_decoding().num_matchers == 0  # every finished request dropped its matcher


def test_speculation_verifies_drafts_against_the_grammar(spec, plain):
    """Greedy constrained decoding gives the same tokens with MTP4 as without, whether the drafts are the
    MTP head's (random weights: mostly outside the grammar, so refused at their masked rows) or the
    constrained continuation itself (all accepted until a special token no grammar allows)."""
    prompts = ["Reply in JSON.", "Pick a code."]
    code = StructuredOutputsParams(regex=r"[a-c]{6}")
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=SMALL),
              SamplingParams(temperature=0, max_tokens=32, structured_outputs=code)]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    full = [p + w.token_ids for p, w in zip([plain.get_tokenizer().encode(p) for p in prompts], want)]
    special = spec.get_tokenizer().token_to_id("<|im_start|>")  # masked everywhere
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=32, structured_outputs=SMALL)
    for mode, drafts_for in (("mtp", None),
                             ("continuation", lambda ids, k: next((f for f in full if f[:len(ids)] == ids), ids)
                              [len(ids):] + [special] * k)):
        undo = replace_drafts(spec, drafts_for) if drafts_for else (lambda: None)
        try:
            extra = [sampled] if mode == "mtp" else []
            got = spec.generate(prompts + prompts[:len(extra)], params + extra, use_tqdm=False)
        finally:
            undo()
        assert [o.outputs[0].token_ids for o in got[:2]] == [w.token_ids for w in want], mode
        st = got[0].metrics.spec_decode
        assert st.num_draft_tokens > 0
        if mode == "mtp":
            check_schema(json.loads(got[2].outputs[0].text), SMALL_SCHEMA)
        if mode == "continuation":  # every draft before the end is the right token
            assert st.num_accepted_tokens >= len(want[0].token_ids) - 2 * st.num_rounds
    check_schema(json.loads(want[0].text), SMALL_SCHEMA)
    assert spec.structured_decoding().num_matchers == 0


def test_thinking_budget_then_the_grammar(spec, plain):
    tok = plain.get_tokenizer()
    end = tok.token_to_id("</think>")
    prompt = plain.chat_prompt([{"role": "user", "content": "Reply in JSON."}], enable_thinking=True)
    params = SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=3, structured_outputs=SMALL)
    out = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[3] == end and end not in out.token_ids[:3]  # the model never closes it by itself
    reasoning, answer = out.text.split("</think>")
    assert out.finish_reason == "stop" and reasoning
    check_schema(json.loads(answer), SMALL_SCHEMA)
    assert spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == out.token_ids
    # thinking off: the template pre-closes the block, so the grammar applies from the first token
    closed = plain.chat_prompt([{"role": "user", "content": "Reply in JSON."}], enable_thinking=False)
    out = plain.generate(closed, params, use_tqdm=False)[0].outputs[0]
    check_schema(json.loads(out.text), SMALL_SCHEMA)
    # a budget alone (no grammar) also ends the reasoning
    out = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=6, thinking_token_budget=2),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids[2] == end


def test_structured_outputs_config_makes_every_request_compact(plain, default_dir, monkeypatch):
    """LLM(structured_outputs_config={"disable_any_whitespace": True}) is the library's form of the server flag."""
    assert compact_json_default(None) is False and compact_json_default({"disable_any_whitespace": True}) is True
    for bad, says in (({"disable_any_whitespace": "yes"}, "must be true or false"), ({"backend": "outlines"},
                      "only xgrammar"), ({"whitespace": False}, "give an object with disable_any_whitespace")):
        with pytest.raises(StructuredOutputError, match=says):  # checked before any weight loads
            LLM(model=str(default_dir), structured_outputs_config=bad)
    loose = SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA))
    free = plain.generate("Reply in JSON.", loose, use_tqdm=False)[0].outputs[0]
    # the random model writes whitespace wherever JSON allows it, until max_tokens
    assert free.finish_reason == "length" or free.text != json.dumps(json.loads(free.text)), free.text
    monkeypatch.setattr(plain, "compact_json", True)
    compact = plain.generate("Reply in JSON.", loose, use_tqdm=False)[0].outputs[0]
    assert compact.finish_reason == "stop", compact.text
    value = json.loads(compact.text)  # xgrammar's one form without free whitespace: ", " and ": " separators
    assert compact.text == json.dumps(value), compact.text
    check_schema(value, SMALL_SCHEMA)


def test_an_aborted_request_frees_its_matcher(plain):
    llm = plain
    rid = llm.add_request("x", SamplingParams(max_tokens=40, structured_outputs=JSON))
    llm.step()
    assert llm.structured_decoding().num_matchers == 1
    llm.abort_request(rid)
    assert llm.structured_decoding().num_matchers == 0 and not llm.has_unfinished_requests()
    with pytest.raises(StructuredOutputError, match="structured_outputs.regex is invalid"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), use_tqdm=False)
    assert llm.structured_decoding().num_matchers == 0
