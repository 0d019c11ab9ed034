"""The sampling half of a step: logits in, tokens appended to their requests, stop rules applied.

`StepSampler.sample` takes the rows of the requests whose next token is due: it masks the embedding
rows that are not text, applies penalties and `min_tokens`, the grammar bitmasks of constrained
requests (one copy to the device per batch), samples, records logprobs and appends each token
(`Request.append` applies EOS, stop ids, stop strings, grammar termination and max_tokens).

`StepSampler.verify` does the same for speculative rows: request i owns 1 + len(drafts[i]) rows; the
drafts are accepted greedily or by rejection sampling (spec/verify.py) and the emitted tokens are
appended one by one, so an EOS or a stop inside them ends the request where decoding without drafts
would. It returns how many drafts each request kept, which the engine commits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..spec.verify import greedy_accept, rejection_sample
from ..tokenizer import Tokenizer
from .request import Logprob, Request
from .sampling import Sampler, SamplingParams, apply_penalties, compute_logprobs, device_tensor
from .structured import apply_row_constraints


def record_logprob(r: Request, entry: dict[int, Logprob]) -> None:
    """Add one sampled token's logprob entry (its chosen token first) to the request."""
    r.logprobs.append(entry)
    r.cumulative_logprob += next(iter(entry.values())).logprob


class PenaltyIds:
    """A penalised request's token ids on the device, as apply_penalties reads them each step: its prompt, copied
    once, and its output so far, in a buffer that grows by the tokens appended since the step before
    (`StepSampler._penalty_ids`). As host lists the penalties' ids cost ~40 ms of host time a step for 8 prompts of
    32K ids and 11-16 ms for 8 outputs of 8K (CPU, RESULTS.md H1); this way a step copies its new tokens only."""

    def __init__(self, request: Request, device: torch.device):
        self.request = request
        self.prompt = device_tensor(request.prompt_token_ids, torch.long, device)  # [P] int64
        self._output = torch.empty(64, dtype=torch.long, device=device)  # [capacity]: the first num_output are set
        self.num_output = 0

    @property
    def output(self) -> Tensor:
        return self._output[:self.num_output]  # [num_output] int64, the request's output ids as of the last extend

    def unseen(self) -> list[int]:
        """The request's output ids appended since the last `extend`."""
        ids = self.request.token_ids
        if len(ids) < self.num_output:  # a request's output only grows (Request.append)
            raise RuntimeError(f"request {self.request.request_id}: its output shrank from {self.num_output} to "
                               f"{len(ids)} tokens while its penalties kept them on the device")
        return ids[self.num_output:]

    def extend(self, new: Tensor) -> None:
        """new: [k] int64 on the device, the `unseen` ids."""
        n = self.num_output + len(new)
        if n > len(self._output):  # doubling: a request's copies into the buffer add up to O(its output)
            grown = torch.empty(max(2 * len(self._output), n), dtype=torch.long, device=self._output.device)
            grown[:self.num_output] = self.output
            self._output = grown
        self._output[self.num_output:n] = new
        self.num_output = n


class StepSampler:
    """Turns a step's logits into appended tokens for the engine's requests.

    eos_token_ids: tokens that end a request (unless ignore_eos); num_text_ids: embedding rows past it are
    padding with no text and are never sampled; tokenizer: decodes the tokens of logprob entries (None: no text).
    """

    def __init__(self, eos_token_ids: frozenset[int], num_text_ids: int, tokenizer: Tokenizer | None = None):
        self.eos_token_ids, self.num_text_ids, self.tokenizer = eos_token_ids, num_text_ids, tokenizer
        self.sampler = Sampler()
        # id(request) -> its ids on the device, for the penalised requests of the last batch (PenaltyIds; the entry
        # holds the request, so its id is not reused while cached)
        self._penalised: dict[int, PenaltyIds] = {}

    def _stop_ids(self, p: SamplingParams) -> tuple[int, ...]:
        """What `min_tokens` masks while too few tokens exist."""
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids))

    def _penalty_ids(self, requests: list[Request], device: torch.device) -> list[PenaltyIds | None]:
        """Each penalised request's ids on the device, brought up to date with one copy for the whole batch (None for
        the others). The cache then holds this batch's penalised requests only."""
        kept: dict[int, PenaltyIds] = {}
        for r in requests:
            if r.params.has_penalties and id(r) not in kept:
                hit = self._penalised.get(id(r))
                kept[id(r)] = hit if hit is not None and hit.prompt.device == device else PenaltyIds(r, device)
        self._penalised = kept
        unseen = [(ids, new) for ids in kept.values() if (new := ids.unseen())]
        if unseen:
            flat = device_tensor([t for _, new in unseen for t in new], torch.long, device)  # [sum k]
            offset = 0
            for ids, new in unseen:
                ids.extend(flat[offset:offset + len(new)])
                offset += len(new)
        return [kept.get(id(r)) for r in requests]

    def _mask_padding(self, logits: Tensor) -> None:
        if self.num_text_ids < logits.shape[-1]:
            logits[:, self.num_text_ids:] = float("-inf")

    def sample(self, requests: list[Request], logits: Tensor) -> None:
        """logits [N, V]: row i is request i's next-token distribution; appends one token to each."""
        token_ids = self.pick(requests, logits)
        if any(r.params.logprobs is not None for r in requests):
            self._record_logprobs(requests, logits, token_ids)
        for r, token_id in zip(requests, token_ids.tolist()):
            r.append(token_id, self.eos_token_ids)

    def pick(self, requests: list[Request], logits: Tensor, in_flight: Tensor | None = None) -> Tensor:
        """The tokens `sample` appends -> [N] int64 on logits.device, without waiting for the device (penalties and
        grammars read the requests' tokens on the host, which they already have); masks the padding rows of logits
        in place. in_flight: [N] each row's token sampled but not yet appended (async scheduling), which the
        penalties count (`apply_penalties`)."""
        self._mask_padding(logits)
        params = [r.params for r in requests]
        sample_logits = logits  # logprobs report the raw model distribution, as vLLM does
        if any(p.adjusts_logits for p in params):
            ids = self._penalty_ids(requests, logits.device)
            sample_logits = apply_penalties(logits, params, [d.prompt if d else [] for d in ids],
                                            [d.output if d else r.token_ids for d, r in zip(ids, requests)],
                                            [self._stop_ids(p) for p in params], in_flight)
        else:
            self._penalised = {}  # no penalised request in this batch: none of its ids is kept
        constrained = [b for b, r in enumerate(requests) if r.constraint is not None]
        if constrained:  # one bitmask copy for the whole batch
            sample_logits = sample_logits.clone() if sample_logits is logits else sample_logits
            bitmasks, forced = [], []
            for b in constrained:
                rows, ends = requests[b].constraint.row_constraints()
                bitmasks += [(b, bits) for _, bits in rows]
                forced += [(b, token) for _, token in ends]
            apply_row_constraints(sample_logits, bitmasks, forced)
        return self.sampler(sample_logits, params, [r.generator for r in requests])

    def verify(self, requests: list[Request], logits: Tensor, drafts: Sequence[Sequence[int]]) -> list[int]:
        """Speculative rows: request i owns 1 + len(drafts[i]) consecutive rows of logits [N, V] (its definite
        token's row, then one per draft). Appends the emitted tokens; returns the drafts each request kept."""
        self._mask_padding(logits)
        # the plain greedy requests' argmax over all rows at once: one launch and one host sync a round, not one per
        # request (a row's argmax does not depend on the rows beside it)
        plain = [r.params.greedy and not r.params.adjusts_logits and r.constraint is None for r in requests]
        argmax = logits.argmax(-1).tolist() if any(plain) else None
        penalty_ids = self._penalty_ids(requests, logits.device)
        accepted, offset = [], 0
        for r, d, is_plain, ids in zip(requests, drafts, plain, penalty_ids):
            n = len(d) + 1
            rows, offset = logits[offset:offset + n], offset + n  # [n, V]
            p = r.params
            sample_rows = rows
            if p.adjusts_logits:  # row j sees the output extended by the drafts before it
                if ids is None:  # min_tokens / logit_bias only: the ids are not counted, their number is
                    prompt, outputs = [], [r.token_ids + list(d[:j]) for j in range(n)]
                else:
                    drafted = torch.cat((ids.output, device_tensor(list(d), torch.long, logits.device)))
                    prompt, outputs = ids.prompt, [drafted[:ids.num_output + j] for j in range(n)]
                sample_rows = apply_penalties(rows, [p] * n, [prompt] * n, outputs, [self._stop_ids(p)] * n)
            if r.constraint is not None:  # row j as the grammar stands after drafts d[:j]
                sample_rows = sample_rows.clone() if sample_rows is rows else sample_rows
                r.constraint.mask_rows(sample_rows, d)
            if is_plain:
                emitted = greedy_accept(argmax[offset - n:offset], d)
            elif p.greedy:
                emitted = greedy_accept(sample_rows.argmax(-1).tolist(), d)
            else:
                q = getattr(d, "probs", None)  # [n - 1, V] when the drafter sampled (DFlash2 probabilistic)
                emitted = rejection_sample(self.sampler.probs(sample_rows, [p] * n), d, q, r.generator)
            appended = []
            for j, token_id in enumerate(emitted):
                if r.finished:
                    break
                if p.logprobs is not None:
                    self._record_logprobs([r], rows[j:j + 1], torch.tensor([token_id], device=rows.device))
                r.append(token_id, self.eos_token_ids)
                appended.append(token_id)
            # the drafts kept: those matched by the tokens appended before the last one (that one is always
            # the target's own: a correction, or the token after the last accepted draft)
            a = 0
            while a < min(len(d), len(appended) - 1) and appended[a] == d[a]:
                a += 1
            accepted.append(a)
        return accepted

    # ---- logprobs -----------------------------------------------------------------------------------
    def _logprob_entries(self, logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
        """Per row: {chosen token: Logprob, + the top num_top[row] alternatives} (one host transfer)."""
        values = compute_logprobs(logits, token_ids, max(num_top))
        return self.logprob_entries(token_ids.tolist(), num_top, *(x.tolist() for x in values))

    def logprob_values(self, requests: list[Request], logits: Tensor, token_ids: Tensor
                       ) -> tuple[list[int], tuple[Tensor, ...]] | None:
        """For a step whose tokens are read later (async scheduling): the rows whose request asks for logprobs and
        `compute_logprobs` of them, left on the device (None: no request asks)."""
        asking = [b for b, r in enumerate(requests) if r.params.logprobs is not None]
        if not asking:
            return None
        rows = device_tensor(asking, torch.long, logits.device)
        return asking, compute_logprobs(logits[rows], token_ids[rows], max(requests[b].params.logprobs for b in asking))

    def logprob_entries(self, token_ids: list[int], num_top: list[int], chosen: list[float], rank: list[int],
                        top_lp: list[list[float]], top_ids: list[list[int]]) -> list[dict[int, Logprob]]:
        """The entries of rows whose `compute_logprobs` values were read to the host."""
        tok = self.tokenizer

        def decode(i: int) -> str | None:
            return tok.decode([i], skip_special_tokens=False) if tok is not None else None

        entries = []
        for b, token_id in enumerate(token_ids):
            entry = {token_id: Logprob(chosen[b], rank[b], decode(token_id))}
            for k in range(num_top[b]):
                entry.setdefault(top_ids[b][k], Logprob(top_lp[b][k], k + 1, decode(top_ids[b][k])))
            entries.append(entry)
        return entries

    def logprob_rows_entries(self, requests: list[Request], token_ids: list[int], rows: list[int],
                             values: list[list]) -> dict[int, dict[int, Logprob]]:
        """Row -> entry for the `rows` of `logprob_values`, from its values read to the host."""
        return dict(zip(rows, self.logprob_entries([token_ids[b] for b in rows],
                                                   [requests[b].params.logprobs for b in rows], *values)))

    def _record_logprobs(self, requests: list[Request], logits: Tensor, token_ids: Tensor) -> None:
        rows, values = self.logprob_values(requests, logits, token_ids)
        entries = self.logprob_rows_entries(requests, token_ids.tolist(), rows, [x.tolist() for x in values])
        for b, entry in entries.items():
            record_logprob(requests[b], entry)

    def prompt_logprobs(self, request: Request, first: int, logits: Tensor) -> None:
        """logits [n, V]: row j predicts prompt token first + j (a preempted request's recompute
        writes the same positions again)."""
        if self.num_text_ids < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.num_text_ids:] = float("-inf")
        n = logits.shape[0]
        targets = torch.tensor(request.prompt_token_ids[first:first + n], device=logits.device)
        request.prompt_logprobs[first:first + n] = self._logprob_entries(logits, targets,
                                                                         [request.params.prompt_logprobs] * n)
