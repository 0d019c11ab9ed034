"""SamplingParams (vLLM names) and the Sampler that turns logits into token ids.

The Sampler works on a whole step at once: logits [N, V] fp32 plus one SamplingParams and one
torch.Generator per row. Temperature, top-k, top-p and min-p are applied as [N]-shaped tensors
(no Python loop over the vocabulary); a row with temperature 0 is greedy. Sampling uses the
exponential-race form of the Gumbel-max trick, argmax(p / E) with E ~ Exp(1), so it needs no
`multinomial` and each row's noise comes from that row's own generator: a seeded request draws
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's field names and defaults.

    n: completions per prompt (sibling i of a seeded request uses seed + i).
    temperature: 0 is greedy; otherwise logits are divided by it.
    top_p: keep the smallest set of tokens whose probability reaches top_p (1 = off).
    top_k: keep the k most likely tokens (0 or -1 = off).
    min_p: drop tokens less likely than min_p times the most likely one (0 = off).
    seed: per-request seed; the same seed gives the same tokens whatever the batch.
    max_tokens: most tokens to generate (None: up to the model's max length).
    stop: strings that end generation; the output text is cut before them.
    stop_token_ids: token ids that end generation (kept in token_ids).
    ignore_eos: keep going past the end-of-sequence tokens (stop_token_ids still apply).
    logprobs: return the log-probabilities of the sampled token and of the top `logprobs` tokens.
    prompt_logprobs: also return, for every prompt position after the first, the log-probability of
        the prompt token there and of the top `prompt_logprobs` tokens (the prompt is then computed
        whole: no prefix-cache hit).
    skip_special_tokens: drop special tokens from the output text.
    detokenize: False leaves the output text empty (token ids only; saves the decoding); stop strings need it.
    include_stop_str_in_output: keep the matched stop string in the text.
    presence_penalty: subtracted from the logit of every token already generated (0 = off).
    frequency_penalty: subtracted once per earlier occurrence in the output (0 = off).
    repetition_penalty: tokens seen in the prompt or output have positive logits divided and
        negative ones multiplied by it (1 = off), as in vLLM / HF.
    min_tokens: end-of-sequence and stop_token_ids are masked until this many tokens exist.
    structured_outputs: constrain the output to a JSON schema, any JSON object, a regex, a choice of
        strings or an EBNF grammar (structured.py; needs xgrammar: pip install revolta[server]). With
        thinking on, the constraint applies after `</think>`. A dict is read as StructuredOutputsParams(**it).
    thinking_token_budget: most tokens of a `<think>` block the prompt opened; then `</think>` is forced
        (vLLM's name; None = no limit, 0 = close it at once).
    logit_bias: {token id: bias} added to those logits before sampling (greedy too), clamped to
        [-100, 100] as vLLM does; ids the model cannot sample are the caller's to refuse.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    logit_bias: Mapping[int, float] | None = None
    # normalised views, filled in __post_init__
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            fail("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an integer >= 1, or 0 / -1 (off)")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1] (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            fail("seed", "must be a 64-bit integer, in [-2**63, 2**63 - 1], or None")  # torch's generator range
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1, or None (up to the model's max length)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            fail("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                fail(name, "must be in [-2, 2] (0 = off)")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty < float("inf"):
            fail("repetition_penalty", "must be a finite number > 0 (1 = off)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        so = self.structured_outputs
        if isinstance(so, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields) or None")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            fail("thinking_token_budget", "must be an integer >= 0 (0 = close the reasoning at once), or None")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not (isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop)):
            fail("stop", "must be a string or a list of strings")
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, Sequence) and all(_is_int(i) and i >= 0 for i in ids)):
            fail("stop_token_ids", "must be a list of token ids (integers >= 0)")
        bias = self.logit_bias
        if bias is not None:
            if not (isinstance(bias, Mapping) and all(_is_int(k) and k >= 0 and isinstance(v, (int, float))
                                                      and not isinstance(v, bool) and math.isfinite(v)
                                                      for k, v in bias.items())):
                fail("logit_bias", "must map token ids (integers >= 0) to finite numbers")
            object.__setattr__(self, "logit_bias", {int(k): min(max(float(v), -100.0), 100.0)
                                                    for k, v in bias.items()} or None)
        object.__setattr__(self, "stop_strings", tuple(s for s in (stop or ()) if s))
        if self.stop_strings and not self.detokenize:
            fail("stop", "stop strings need detokenize=True (they match the text); use stop_token_ids instead")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids) if ids is not None else ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """Whether a RequestConstraint (structured.py) shapes this request's logits."""
        return self.structured_outputs is not None or self.thinking_token_budget is not None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether apply_penalties changes this request's logits."""
        return self.has_penalties or self.min_tokens > 0 or self.logit_bias is not None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed` (one per request). Any Python int is taken modulo 2**64, read
    as a signed 64-bit value (what manual_seed accepts): SamplingParams keeps seeds in [-2**63, 2**63), which are used
    as they are; the wrap serves the n > 1 siblings of the largest ones (seed + i)."""
    seed = int(seed) & (2**64 - 1)
    return torch.Generator(device=device).manual_seed(seed - 2**64 if seed >= 2**63 else seed)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A small host list as a tensor on `device` without waiting for the device: through pinned memory on CUDA (a
    pageable copy synchronizes the stream, which would wait for an asynchronous step's forward: async_step.py)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


class Sampler:
    """logits [N, V] fp32 + one SamplingParams and generator per row -> token ids [N]."""

    def __call__(self, logits: Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> Tensor:
        """Pick one token per row.

        logits: [N, V] fp32 raw model logits (not modified).
        params: N SamplingParams; rows with temperature 0 take the argmax.
        generators: N generators on logits.device (None only for greedy rows).
        Returns: [N] int64 token ids on logits.device.
        """
        N = logits.shape[0]
        if len(params) != N or len(generators) != N:
            raise ValueError(f"{N} logits rows but {len(params)} params and {len(generators)} generators")
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):  # decided from the params on the host: no device sync
            return greedy_ids
        is_greedy = device_tensor([p.greedy for p in params], torch.bool, logits.device)
        probs = self.probs(logits, params)
        noise = torch.empty_like(probs)
        for row, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                noise[row].fill_(1.0)
            else:
                noise[row].exponential_(generator=gen)
        sampled_ids = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_ids, sampled_ids)

    @staticmethod
    def probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        """The sampling distribution of each row: [N, V] after temperature, top-k, top-p and min-p.

        Greedy rows get temperature 1 here (their distribution is not used for the pick). Which
        filters run is decided from the params on the host, so this never waits on the device.
        """
        device = logits.device
        temperature = device_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32,
                                    device)
        logits = logits / temperature[:, None]
        V = logits.shape[-1]
        ks = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
        top_k = device_tensor(ks, torch.int64, device)
        top_p = device_tensor([p.top_p for p in params], logits.dtype, device)
        min_p = device_tensor([p.min_p for p in params], logits.dtype, device)
        if min(ks) < V or any(p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, top_k, top_p, k_max=max(ks))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]], stop_ids: Sequence[Sequence[int]],
                    in_flight: Tensor | None = None) -> Tensor:
    """Logit processors applied before sampling, vectorised over the batch (returns a new tensor).

    logits: [N, V] fp32; prompt_ids / output_ids: each row's tokens so far, lists or int64 tensors on logits.device
    (StepSampler keeps a penalised request's ids there across its steps: `PenaltyIds`); stop_ids: per row the
    end-of-sequence and stop token ids that `min_tokens` masks while too few tokens exist. in_flight: [N] int64 on
    logits.device, each row's output token that the host has not read yet (async scheduling: the step's input ids,
    sampled by the step before; output_ids lack it), counted as one more output token. The host lists reach the
    device in a few copies through pinned memory, so nothing here waits for the device.
    """
    N, V = logits.shape
    device = logits.device
    out = logits.clone()
    extra = 0 if in_flight is None else 1
    penalised = [row for row, p in enumerate(params) if p.has_penalties]
    if penalised:
        counts = torch.zeros(N, V, device=device)
        # the penalised rows' output ids (another row's counts would meet a zero penalty: the same logits)
        outputs = [output_ids[row] for row in penalised]
        total = sum(len(o) for o in outputs)
        if total:
            rows = torch.repeat_interleave(device_tensor(penalised, torch.long, device),
                                           device_tensor([len(o) for o in outputs], torch.long, device),
                                           output_size=total)  # [total]; output_size: no device sync
            ids = torch.cat([o if isinstance(o, Tensor) else device_tensor(o, torch.long, device)
                             for o in outputs if len(o)])  # [total]
            counts.index_put_((rows, ids), torch.ones(total, device=device), accumulate=True)
        if in_flight is not None:
            counts.index_put_((torch.arange(N, device=device), in_flight), torch.ones(N, device=device),
                              accumulate=True)
        seen = counts > 0
        for row, prompt in enumerate(prompt_ids):  # StepSampler passes device tensors; a list is copied here
            if len(prompt):
                seen[row, prompt if isinstance(prompt, Tensor) else device_tensor(prompt, torch.long, device)] = True
        rep = device_tensor([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
        freq = device_tensor([p.frequency_penalty for p in params], torch.float32, device)[:, None]
        pres = device_tensor([p.presence_penalty for p in params], torch.float32, device)[:, None]
        out = out - freq * counts - pres * (counts > 0).float()
    bias = [(row, t, b) for row, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items() if t < V]
    if bias:  # one addition an entry (a request's logit_bias keys are distinct)
        out.index_put_((device_tensor([r for r, _, _ in bias], torch.long, device),
                        device_tensor([t for _, t, _ in bias], torch.long, device)),
                       device_tensor([b for _, _, b in bias], out.dtype, device), accumulate=True)
    masked = [(row, t) for row, (p, output, stops) in enumerate(zip(params, output_ids, stop_ids))
              if len(output) + extra < p.min_tokens for t in stops if t < V]
    if masked:
        out[device_tensor([r for r, _ in masked], torch.long, device),
            device_tensor([t for _, t in masked], torch.long, device)] = float("-inf")
    return out


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, k_max: int) -> Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus.

    logits: [N, V]; top_k: [N] int in [1, V]; top_p: [N] in (0, 1]; k_max: max(top_k) as a host int.
    The most likely token always stays.
    """
    if k_max < logits.shape[-1]:  # every row has a top-k: a partial sort is enough
        sorted_logits, order = logits.topk(k_max, dim=-1)  # [N, k_max], descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(sorted_logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # a token is dropped when the tokens ranked above it already reach top_p
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p[:, None]) & (rank[None, :] > 0) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Raw-model log-probabilities for the chosen tokens and the top `num_top` alternatives.

    logits: [N, V]; token_ids: [N].
    Returns (chosen_logprob [N], chosen_rank [N] (1 = most likely), top_logprobs [N, k], top_ids [N, k]).
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])  # [N, 1]
    rank = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # num_top may be 0: [N, 0]
    return chosen[:, 0], rank, top_logprobs, top_ids
