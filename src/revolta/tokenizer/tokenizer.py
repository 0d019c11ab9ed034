"""`Tokenizer` (encode / decode / stop tokens / chat template of a checkpoint directory) and streaming:
`IncrementalDetokenizer` turns token ids into text deltas that never split a UTF-8 character; `StopChecker`
cuts the text before a stop string and holds back a possible partial match."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from .chat_template import render_chat_template
from .qwen_build import QWEN_MODEL_MAX_LENGTH, STOP_TOKENS, write_qwen_tokenizer_dir


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json stores a token as a string or as a serialised AddedToken {"content": ...}.
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _load_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    # A chat_template.jinja file wins over tokenizer_config.json, as in transformers.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class Tokenizer:
    """Byte-level BPE tokenizer of a checkpoint: encode/decode, stop tokens and the chat template.

    Build with `Tokenizer.from_pretrained(checkpoint_dir)` or, without a checkpoint,
    `Tokenizer.from_qwen_ranks(cache_dir)`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        eos_token: str | None = "<|im_end|>",
        pad_token: str | None = "<|endoftext|>",
        bos_token: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        model_max_length: int = QWEN_MODEL_MAX_LENGTH,
    ):
        """Wrap a loaded backend; prefer `from_pretrained`.

        Args:
            backend: the loaded `tokenizers.Tokenizer`.
            chat_template: jinja source, or None (then `apply_chat_template` raises).
            eos_token, pad_token, bos_token: token strings from tokenizer_config.json.
            extra_stop_token_ids: more ids that end generation (generation_config.json `eos_token_id`).
            model_max_length: longest prompt + output, in tokens.
        """
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.model_max_length = model_max_length
        self.added_tokens: dict[int, AddedToken] = dict(backend.get_added_tokens_decoder())
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in self.added_tokens.items() if t.special)
        stop_names = [*STOP_TOKENS, *([eos_token] if eos_token else [])]
        stop_ids = [self.token_to_id(name) for name in stop_names] + list(extra_stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stop_ids if i is not None))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja (and generation_config.json).

        Args:
            path: checkpoint (or tokenizer) directory.
        Returns:
            Tokenizer.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path}/tokenizer.json not found; build one offline with "
                "revolta.tokenizer.write_qwen_tokenizer_dir(dir) or Tokenizer.from_qwen_ranks(dir)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        return cls(
            backend,
            chat_template=_load_chat_template(path, config),
            eos_token=_token_content(config.get("eos_token", "<|im_end|>")),
            pad_token=_token_content(config.get("pad_token", "<|endoftext|>")),
            bos_token=_token_content(config.get("bos_token")),
            extra_stop_token_ids=[generation_eos] if isinstance(generation_eos, int) else generation_eos,
            model_max_length=int(config.get("model_max_length", QWEN_MODEL_MAX_LENGTH)),
        )

    @classmethod
    def from_qwen_ranks(cls, cache_dir: str | os.PathLike) -> Tokenizer:
        """Build (or reuse) a Qwen3.5-family tokenizer in `cache_dir` from `qwen-tokenizer`, offline.

        Args:
            cache_dir: where tokenizer.json / tokenizer_config.json / chat_template.jinja are written.
        Returns:
            Tokenizer with the preset chat template.
        """
        return cls.from_pretrained(write_qwen_tokenizer_dir(cache_dir))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (BPE + added); the model's embedding may be larger."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the tokenizer's `eos_token` (`<|im_end|>` for Qwen), or None."""
        return self.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of the `pad_token` (`<|endoftext|>` for Qwen), or None."""
        return self.token_to_id(self.pad_token) if self.pad_token else None

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (byte-level spelling for BPE tokens), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Added-token strings in the text (e.g. `<|im_start|>`) become their ids;
        no BOS/EOS is added (Qwen has none)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts, in parallel inside `tokenizers`."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. Invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD.

        skip_special_tokens drops the `special` added tokens (`<|im_end|>`, `<|image_pad|>`, ...) but keeps
        `<think>`, `<tool_call>` and the other non-special ones, which the output parsers need. Ids past
        the tokenizer (the model's unused embedding rows 248077..248319) decode to nothing.
        """
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool | None = None,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the checkpoint's chat template (see `render_chat_template`; add_generation_prompt None means
        "unless continue_final_message", which leaves the final assistant message open for generation to continue).

        Image parts render as `<|vision_start|><|image_pad|><|vision_end|>` and video parts with
        `<|video_pad|>`: one pad each; the multimodal layer expands pads to the real count.

        Returns:
            str: prompt text; `encode` it to get ids.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return render_chat_template(
            self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            continue_final_message=continue_final_message,
            **{**specials, **kwargs},
        )


# Streaming


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for streaming.

    The text of a token window is re-decoded from the last emitted boundary: `prefix_offset` marks where
    the window starts, `read_offset` how far text was already emitted. A delta is emitted only when the
    window's text does not end with U+FFFD, i.e. no UTF-8 character is cut, so a character split over
    several byte tokens (CJK, emoji) comes out whole. Concatenated deltas (plus `flush()`) equal
    `tokenizer.decode(all_ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        """Start an empty stream.

        Args:
            tokenizer: the `Tokenizer` to decode with.
            skip_special_tokens: drop special added tokens (not `<think>`/`<tool_call>`), like `decode`.
        """
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # kept ids (special ones already dropped when skipping)
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one id or several; return the new text that is safe to show (possibly "")."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self.skip_special_tokens:
            ids = [i for i in ids if i not in self.tokenizer.all_special_ids]
        if not ids:
            return ""
        self.token_ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: return any held-back text, even if it ends with U+FFFD (truly invalid bytes)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.backend.decode
        window = self.token_ids[self.prefix_offset :]
        emitted = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=False)
        full = decode(window, skip_special_tokens=False)
        if len(full) <= len(emitted) or (full.endswith("\ufffd") and not final):
            return ""  # hold back: a multi-byte character is still incomplete
        delta = full[len(emitted) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta


class StopChecker:
    """Cut streamed text at the first stop string, as vLLM does (the stop string is not output).

    `feed(delta)` returns the text that is safe to emit now: it holds back a tail that could be the start
    of a stop string until the next delta settles it. Once a stop string is found, `stop` is set and all
    later input is dropped.
    """

    def __init__(self, stop: Sequence[str] | str | None, include_stop_str_in_output: bool = False):
        """Start with nothing held back.

        Args:
            stop: stop strings (empty strings are ignored).
            include_stop_str_in_output: keep the matched stop string in the output (vLLM option).
        """
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.pending = ""  # held-back tail that may begin a stop string
        self.stop: str | None = None  # the matched stop string, once found

    @property
    def finished(self) -> bool:
        """True once a stop string was matched."""
        return self.stop is not None

    def feed(self, delta: str) -> str:
        """Add streamed text; return the part that can be emitted now ("" after a stop)."""
        if self.finished:
            return ""
        text = self.pending + delta
        match = self._first_match(text)
        if match is not None:
            index, self.stop = match
            self.pending = ""
            return text[: index + len(self.stop)] if self.include_stop_str_in_output else text[:index]
        keep = self._partial_match_len(text)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of stream without a stop: release the held-back tail."""
        out, self.pending = ("" if self.finished else self.pending), ""
        return out

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Earliest position wins; at the same position, the stop string listed first.
        found = [(i, n, s) for n, s in enumerate(self.stop_strings) if (i := text.find(s)) >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _partial_match_len(self, text: str) -> int:
        # Longest suffix of `text` that is a proper prefix of some stop string.
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
