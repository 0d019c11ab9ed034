"""Constrained decoding: structured outputs (JSON schema, JSON, regex, choice, EBNF) and thinking budgets.

`SamplingParams.structured_outputs = StructuredOutputsParams(json=schema)` (vLLM's names) makes every
generated token one the grammar allows, and `SamplingParams.thinking_token_budget = n` ends a
`<think>` block after n reasoning tokens by forcing `</think>`. Both live in one `RequestConstraint`
per request, which the sampler asks for each logits row:

- Reasoning: when the prompt leaves a `<think>` block open (the Qwen chat template with thinking on),
  the request starts in the reasoning phase; the grammar applies only after `</think>` is emitted, so
  the reasoning is free text and the answer parses. The budget counts the tokens of that phase.
- Grammar: xgrammar 0.2 (`pip install revolta[server]`, imported only when a request asks for a
  grammar). `StructuredDecoding` (one per LLM, no global state) builds the xgrammar TokenizerInfo
  from revolta's own tokenizer, compiles each distinct spec once into a bounded LRU cache, and gives
  each request its own GrammarMatcher; the request drops it when it finishes.
- Speculative decoding: `mask_rows(rows, drafts)` masks row j as the grammar stands after the
  request's tokens plus drafts[:j] (the matcher steps through the drafts, then rolls back), so
  verification accepts a draft only where constrained decoding could have produced it. The request
  then advances with the tokens it really emitted (`accept`).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

INSTALL_HINT = "structured outputs need xgrammar: pip install 'revolta[server]' (or pip install xgrammar)"
THINK_START, THINK_END = "<think>", "</think>"
DEFAULT_GRAMMAR_CACHE_SIZE = 64  # distinct compiled grammars kept per LLM
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed-check banner
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputError(ValueError):
    """A structured-outputs spec that cannot be used; `param` names the field (e.g. "structured_outputs.json")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the output, with vLLM's names.

    json: a JSON schema (dict, or its JSON text); the output is one JSON value valid against it.
    json_object: True: the output is any JSON object.
    regex: the output matches this regular expression (whole output).
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar / GBNF syntax, start rule `root`).
    structural_tag: an xgrammar structural tag (dict, or its JSON text), e.g. the qwen3_coder call format
        the server forces for tool_choice "required" / named (server/tool_grammar.py).
    disable_any_whitespace: JSON without free whitespace between tokens (compact separators).
    """

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Mapping[str, Any] | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            which = f"got {', '.join(given)}" if given else "none was set"
            raise StructuredOutputError(f"StructuredOutputsParams needs exactly one of {', '.join(_KINDS)}; {which}",
                                        "structured_outputs")
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            what = "a JSON schema" if kind == "json" else "an xgrammar structural tag"
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise StructuredOutputError(f"structured_outputs.{kind} is not valid JSON: {e}; pass {what} "
                                                "object", f"structured_outputs.{kind}") from None
            if not isinstance(value, Mapping) and not (kind == "json" and isinstance(value, bool)):
                raise StructuredOutputError(f"structured_outputs.{kind} must be {what} object, got "
                                            f"{type(value).__name__}", f"structured_outputs.{kind}")
            object.__setattr__(self, kind, value)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"structured_outputs.{kind} must be a non-empty string",
                                            f"structured_outputs.{kind}")
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, Sequence) or not value \
                    or not all(isinstance(c, str) and c for c in value):
                raise StructuredOutputError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                            "structured_outputs.choice")
            object.__setattr__(self, "choice", tuple(value))
        elif value is not True:
            raise StructuredOutputError("structured_outputs.json_object must be true", "structured_outputs.json_object")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        text = json.dumps(value, sort_keys=True) if kind in ("json", "choice", "structural_tag") else str(value)
        return kind, text, self.disable_any_whitespace

    def check(self) -> None:
        """Parse the spec without a tokenizer (cheap): raise StructuredOutputError naming the field if it is
        invalid, so a server can answer 400 before queueing anything."""
        xgr = import_xgrammar()
        kind = self.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_schema_text(self.json), any_whitespace=not self.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(self.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(self.grammar)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(json.dumps(self.structural_tag))
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"structured_outputs.{kind} is invalid: {xgrammar_message(e)}",
                                        f"structured_outputs.{kind}") from None


def compact_json_default(value: Mapping[str, Any] | None, where: str = "structured_outputs_config") -> bool:
    """vLLM's structured_outputs_config ({"disable_any_whitespace": bool, "backend"?: "xgrammar"}, from `LLM(...)` or
    `--structured-outputs-config`) -> whether every structured request gets compact JSON."""
    if value is None:
        return False
    if not isinstance(value, Mapping) or set(value) - {"disable_any_whitespace", "backend"}:
        raise StructuredOutputError(f"{where} {json.dumps(value, default=str)}: give an object with "
                                    "disable_any_whitespace (true/false) and optionally backend \"xgrammar\"", where)
    if value.get("backend", "xgrammar") not in ("xgrammar", "auto"):
        raise StructuredOutputError(f"{where} backend {value['backend']!r}: only xgrammar is available", where)
    if not isinstance(value.get("disable_any_whitespace", False), bool):
        raise StructuredOutputError(f"{where} disable_any_whitespace must be true or false", where)
    return value.get("disable_any_whitespace", False)


def import_xgrammar() -> Any:
    """The xgrammar module, imported on first use; a clear error when it is not installed."""
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputError(INSTALL_HINT, "structured_outputs") from None
    return xgrammar


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its C++ source location."""
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def _schema_text(schema: Mapping[str, Any] | bool) -> str:
    return json.dumps(schema)


def _choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string escapes are valid EBNF string-literal escapes in xgrammar
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def vocab_bytes(tokenizer: Any) -> list[bytes]:
    """Each token id's bytes, for xgrammar's RAW vocabulary. Special added tokens (`<|im_end|>`, image pads,
    ...) get b"", which xgrammar treats as never allowed inside a grammar; non-special added tokens
    (`<think>`, `<tool_call>`, ...) are their text."""
    from ..tokenizer import byte_to_unicode

    symbol_to_byte = {c: b for b, c in enumerate(byte_to_unicode())}
    added = tokenizer.added_tokens
    out = []
    for i in range(tokenizer.vocab_size):
        if i in added:
            out.append(b"" if added[i].special else added[i].content.encode())
        else:
            out.append(bytes(symbol_to_byte[c] for c in tokenizer.id_to_token(i)))
    return out


def reasoning_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """(`<think>` id, `</think>` id) of the tokenizer, None where it has no such token."""
    if tokenizer is None:
        return None, None
    return tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)


def prompt_opens_reasoning(prompt_ids: Sequence[int], think_start: int | None, think_end: int | None) -> bool:
    """Whether the prompt leaves a `<think>` block open: its last `<think>` comes after its last `</think>`."""
    if think_start is None:
        return False
    last_start = last_end = -1
    for i, t in enumerate(prompt_ids):
        if t == think_start:
            last_start = i
        elif t == think_end:
            last_end = i
    return last_start > last_end


class StructuredDecoding:
    """Grammars for one tokenizer: xgrammar TokenizerInfo + compiler, a bounded cache of compiled grammars.

    Built lazily by the LLM on its first structured request (the TokenizerInfo takes ~1 s for the 248K
    Qwen vocabulary). `vocab_size` is the model's logits width (the mask covers every row).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE):
        xgr = import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(vocab_bytes(tokenizer), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: this class keeps the bound (entries, not bytes) and the count
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0  # compilations done (cache misses)
        self.num_matchers = 0  # matchers open now (one per running constrained request)
        self.bitmask_words = xgr.get_bitmask_shape(1, vocab_size)[1]

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`, from the cache when this spec was seen recently."""
        key = spec.key()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        kind, c, any_ws = spec.kind, self._compiler, not spec.disable_any_whitespace
        try:
            if kind == "json":
                compiled = c.compile_json_schema(_schema_text(spec.json), any_whitespace=any_ws)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws, strict_mode=False)
            elif kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(_choice_ebnf(spec.choice))
            elif kind == "structural_tag":
                compiled = c.compile_structural_tag(json.dumps(spec.structural_tag))
            else:
                compiled = c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"structured_outputs.{kind} is invalid: {xgrammar_message(e)}",
                                        f"structured_outputs.{kind}") from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh GrammarMatcher for one request (counted until `release`)."""
        m = self._xgr.GrammarMatcher(self.compile(spec))
        self.num_matchers += 1
        return m

    def release(self) -> None:
        self.num_matchers -= 1


class RequestConstraint:
    """One request's constraint: the grammar (a matcher, or None), the reasoning phase and its budget.

    Args:
        decoding: the LLM's StructuredDecoding when the request has a grammar, else None.
        spec: the request's StructuredOutputsParams (None: budget only).
        in_reasoning: the prompt left `<think>` open, so generation starts in the reasoning.
        think_end: the `</think>` token id (needed when in_reasoning).
        budget: most reasoning tokens before `</think>` is forced (None: no limit).
    """

    def __init__(self, decoding: StructuredDecoding | None, spec: StructuredOutputsParams | None,
                 in_reasoning: bool, think_end: int | None, budget: int | None):
        self._decoding = decoding
        self._matcher = decoding.matcher(spec) if decoding is not None and spec is not None else None
        self.in_reasoning = in_reasoning and think_end is not None
        self.think_end = think_end
        self.budget = budget
        self.num_reasoning_tokens = 0

    @property
    def has_grammar(self) -> bool:
        return self._matcher is not None

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a complete output (and its stop token): nothing more may follow."""
        return self._matcher is not None and self._matcher.is_terminated()

    def _forced_end(self) -> bool:
        return self.in_reasoning and self.budget is not None and self.num_reasoning_tokens >= self.budget

    def accept(self, token_id: int) -> bool:
        """Advance with one emitted token; False when the grammar does not allow it (a bug upstream)."""
        if self.in_reasoning:
            if token_id == self.think_end:
                self.in_reasoning = False
            else:
                self.num_reasoning_tokens += 1
            return True
        if self._matcher is None or self._matcher.is_terminated():
            return self._matcher is None
        return bool(self._matcher.accept_token(token_id))

    def mask_rows(self, logits: Tensor, drafts: Sequence[int] = ()) -> None:
        """Constrain logits [n, V] in place, n = 1 + len(drafts): row j as the request stands after drafts[:j]
        (`row_constraints` then `apply_row_constraints`)."""
        bitmasks, forced = self.row_constraints(drafts)
        apply_row_constraints(logits, bitmasks, forced)

    def row_constraints(self, drafts: Sequence[int] = ()) -> tuple[list[tuple[int, Tensor]], list[tuple[int, int]]]:
        """What rows 0..len(drafts) may hold, row j as the request stands after drafts[:j]: (row, packed
        bitmask [1, W] int32 on the CPU) for grammar rows, (row, token id) for rows forced to one token.

        Rows past a draft the constraint refuses are left free: verification rejects that draft at its
        own (constrained) row, so they are never used. The constraint's state is unchanged afterwards.
        """
        saved = (self.in_reasoning, self.num_reasoning_tokens)
        stepped = 0  # draft tokens the matcher accepted (rolled back at the end)
        bitmasks: list[tuple[int, Tensor]] = []
        forced: list[tuple[int, int]] = []
        try:
            for j in range(len(drafts) + 1):
                is_forced = self._forced_end()
                if is_forced:
                    forced.append((j, self.think_end))
                elif not self.in_reasoning and self._matcher is not None and not self._matcher.is_terminated():
                    bitmask = torch.zeros(1, self._decoding.bitmask_words, dtype=torch.int32)
                    self._matcher.fill_next_token_bitmask(bitmask)
                    bitmasks.append((j, bitmask))
                if j == len(drafts) or (is_forced and drafts[j] != self.think_end):
                    break
                was_grammar = not self.in_reasoning and self._matcher is not None
                if not self.accept(drafts[j]):
                    break
                stepped += was_grammar
        finally:
            if stepped:
                self._matcher.rollback(stepped)
            self.in_reasoning, self.num_reasoning_tokens = saved
        return bitmasks, forced

    def close(self) -> None:
        """Drop the matcher (the request finished or was aborted)."""
        if self._matcher is not None:
            self._matcher = None
            self._decoding.release()


def apply_row_constraints(logits: Tensor, bitmasks: Sequence[tuple[int, Tensor]],
                          forced: Sequence[tuple[int, int]]) -> None:
    """Apply `RequestConstraint.row_constraints` results to logits [N, V] in place (rows index N); the
    bitmasks of every row go to the device in one copy. A forced row keeps only its token (its logit,
    or 0 where that was -inf)."""
    for row, token in forced:
        keep = logits[row, token].clone()
        logits[row].fill_(float("-inf"))
        logits[row, token] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
    if bitmasks:
        bits = torch.cat([b for _, b in bitmasks]).to(logits.device, non_blocking=True)  # [R, W]
        allowed = unpack_bitmask(bits, logits.shape[-1])  # [R, V] bool
        index = torch.tensor([row for row, _ in bitmasks], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """xgrammar's packed bitmask [N, W] int32 (bit b of word w = token 32*w + b) -> allowed [N, vocab_size] bool."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
