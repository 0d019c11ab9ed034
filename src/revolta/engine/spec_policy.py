"""When to draft: speculative rounds only while they pay, measured per batch-size bucket.

The policy ("draft_policy": "adaptive", the default of speculative_config):

- Steps are grouped by bucket: the power of two >= the number of decoding requests (1, 2, 4, 8, ...).
  Only pure decode steps are measured (a step with a prefill chunk costs more for reasons that have
  nothing to do with drafting).
- Per bucket, the last `cost_window` plain steps give P, the least wall seconds per request of a plain
  decode step (1 token per request), the last `cost_window` speculative rounds give S, the least wall
  seconds per request of a round, and the last `window` rounds give A, the mean tokens a round emits
  per request (accepted drafts + 1). The least, not the mean: on a shared machine a step is only ever
  slowed down by others (a long window remembers a quiet moment through a busy stretch), and the first
  step of each kind pays one-time costs (allocations, the first seeding of the drafter).
- Drafting pays while A / S >= 1 / P, i.e. while the estimated speedup A * P / S is at least 1.
- A bucket starts drafting (the configured default, MTP4): after `warmup` rounds it runs `probe_steps`
  plain steps, then decides. From then on the mode in use is measured on every step and the other
  mode is probed for `probe_steps` steps after every `interval` steps; the interval starts at
  `first_probe`, doubles whenever a probe leaves the decision as it was (up to `max_interval`) and
  starts over when the decision flips.

Which mode runs never changes a greedy output: a plain step and a verify round compute the same
rows (spec/verify.py), and a plain step keeps the drafter's rows so drafting can resume.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """What the policy reads time from: seconds, monotonic (time.perf_counter; tests pass a fake)."""

    def __call__(self) -> float: ...


@dataclass(frozen=True)
class SpecPolicyConfig:
    """warmup: rounds before the first plain probe; probe_steps: steps of the other mode per probe;
    first_probe / max_interval: steps in one mode before a probe, doubling; window: rounds whose acceptance
    counts; cost_window: steps of each mode whose least cost counts."""

    warmup: int = 1
    probe_steps: int = 1
    first_probe: int = 32
    max_interval: int = 1024
    window: int = 8
    cost_window: int = 64

    def __post_init__(self) -> None:
        for name in ("warmup", "probe_steps", "first_probe", "max_interval", "window", "cost_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"SpecPolicyConfig {name}={getattr(self, name)} must be >= 1")


@dataclass
class _Bucket:
    """One batch-size bucket's samples and where it stands."""

    size: int  # the bucket: batches of size // 2 + 1 .. size requests
    window: int  # rounds whose acceptance counts
    cost_window: int  # steps of each mode whose least cost counts
    interval: int
    plain: deque = field(init=False)  # seconds per request of plain steps
    spec: deque = field(init=False)  # (seconds per request, tokens per request) of rounds
    drafting: bool = True  # the mode in use
    decided: bool = False  # a first decision was taken (after the warmup rounds and the first probe)
    steps: int = 0  # steps in the mode in use since the last probe
    probe_left: int = 0  # steps of the other mode still to run in the current probe

    def __post_init__(self) -> None:
        self.plain, self.spec = deque(maxlen=self.cost_window), deque(maxlen=self.cost_window)

    def acceptance(self) -> float:
        """A: mean tokens per request of the last `window` rounds."""
        return statistics.fmean(t for _, t in list(self.spec)[-self.window:])

    def speedup(self) -> float | None:
        """A * P / S, or None until both modes were measured."""
        if not self.plain or not self.spec:
            return None
        return self.acceptance() * min(self.plain) / min(s for s, _ in self.spec)


def bucket_of(num_seqs: int) -> int:
    """The power of two >= num_seqs (>= 1)."""
    return 1 << max(0, num_seqs - 1).bit_length()


class SpecPolicy:
    """Per step: `should_draft(n)` before scheduling n decoding requests (it also starts the step's clock),
    then `record(...)` of what ran."""

    def __init__(self, config: SpecPolicyConfig = SpecPolicyConfig(), clock: Clock = time.perf_counter):
        self.config, self.clock = config, clock
        self.buckets: dict[int, _Bucket] = {}
        self.last_bucket: int | None = None  # the bucket of the last recorded step
        self._start = 0.0  # clock() when the current step was decided

    def _bucket(self, num_seqs: int) -> _Bucket:
        b = bucket_of(num_seqs)
        if b not in self.buckets:
            self.buckets[b] = _Bucket(b, self.config.window, self.config.cost_window, interval=self.config.warmup)
        return self.buckets[b]

    def should_draft(self, num_seqs: int) -> bool:
        """Whether the next step drafts, for a batch of num_seqs decoding requests."""
        self._start = self.clock()
        st = self._bucket(num_seqs)
        return not st.drafting if st.probe_left else st.drafting

    def record(self, num_seqs: int, drafted: bool, tokens: int) -> None:
        """The step decided last was a pure decode step of num_seqs requests, ran `drafted` (a round) or
        plainly and emitted `tokens` in all; its cost is the wall time since `should_draft`."""
        seconds = self.clock() - self._start
        if num_seqs < 1:
            return
        st = self._bucket(num_seqs)
        self.last_bucket = bucket_of(num_seqs)
        if drafted:
            st.spec.append((seconds / num_seqs, tokens / num_seqs))
        else:
            st.plain.append(seconds / num_seqs)
        if drafted != st.drafting:  # a probe step of the other mode
            if st.probe_left:
                st.probe_left -= 1
                if not st.probe_left:
                    self._decide(st)
            return
        st.steps += 1
        if st.steps >= st.interval:
            st.steps, st.probe_left = 0, self.config.probe_steps

    def _decide(self, st: _Bucket) -> None:
        speedup = st.speedup()
        if speedup is None:
            return
        pays = speedup >= 1.0
        first, st.decided = not st.decided, True
        if pays == st.drafting and not first:
            st.interval = min(2 * st.interval, self.config.max_interval)
            return
        st.interval = self.config.first_probe
        if pays != st.drafting:
            st.drafting = pays
            logger.info("speculative decoding %s at batch size bucket %d: %s; probing again in %d steps",
                        "resumed" if pays else "paused", st.size, self.reason(st), st.interval)

    # ---- what the logs and /metrics read ---------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Drafting is paused in the bucket of the last measured step."""
        st = self.buckets.get(self.last_bucket) if self.last_bucket is not None else None
        return st is not None and not st.drafting

    def estimated_speedup(self) -> float | None:
        """The last measured bucket's estimated tokens/s with drafting over without (None: not measured yet)."""
        st = self.buckets.get(self.last_bucket) if self.last_bucket is not None else None
        return None if st is None else st.speedup()

    def reason(self, st: _Bucket | None = None) -> str:
        """Why the bucket (default: the last measured one) drafts or not, with the measured figures."""
        st = st or (self.buckets.get(self.last_bucket) if self.last_bucket is not None else None)
        if st is None or st.speedup() is None:
            return "not measured yet"
        accept = st.acceptance()
        round_s, plain_s = min(s for s, _ in st.spec), min(st.plain)
        return (f"a round emits {accept:.2f} tokens per request in {round_s * 1e3:.1f} ms per request against "
                f"{plain_s * 1e3:.1f} ms per request for a plain step: estimated {st.speedup():.2f}x")

