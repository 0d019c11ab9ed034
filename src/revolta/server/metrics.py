"""Server metrics in the Prometheus text format (vLLM's `vllm:` names, so existing dashboards work).

Counters and histograms are updated from the engine thread (`on_output`, `on_finish`) and rendered
from the event loop (`render`), hence the lock. Gauges come from the loop's EngineStats snapshot.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..engine.request import RequestOutput
from .engine_loop import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]
        return out


@dataclass
class _Progress:
    """Per-request bookkeeping for latencies: tokens seen and when the last one arrived."""

    arrival: float
    tokens: dict[int, int] = field(default_factory=dict)
    last_time: float | None = None


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._progress: dict[str, _Progress] = {}

    def on_output(self, out: RequestOutput, now: float) -> None:
        """Engine thread: one RequestOutput of one completion gained tokens."""
        with self._lock:
            p = self._progress.get(out.request_id)
            if p is None:
                arrival = out.metrics.arrival_time if out.metrics is not None else now
                p = self._progress[out.request_id] = _Progress(arrival)
                self.prompt_tokens += len(out.prompt_token_ids)
                self.ttft.observe(now - arrival)
            elif p.last_time is not None:
                self.itl.observe(now - p.last_time)
            c = out.outputs[0]
            self.generation_tokens += len(c.token_ids) - p.tokens.get(c.index, 0)
            p.tokens[c.index], p.last_time = len(c.token_ids), now

    def on_finish(self, request_id: str, reason: str, now: float | None = None) -> None:
        """Engine thread: a request left the engine (stop, length, abort, error)."""
        with self._lock:
            self.finished[reason] += 1
            p = self._progress.pop(request_id, None)
            if p is not None and reason in ("stop", "length"):
                self.e2e.observe((now or time.time()) - p.arrival)

    def render(self, stats: EngineStats) -> str:
        m = f'model_name="{self.model_name}"'
        with self._lock:
            lines = [
                "# HELP vllm:num_requests_running Requests being computed in the engine.",
                "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{m}}} {stats.num_running}",
                "# HELP vllm:num_requests_waiting Requests queued for the engine.",
                "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{m}}} {stats.num_waiting}",
                "# HELP vllm:kv_cache_usage_perc Fraction of KV cache blocks held by requests (1 = full).",
                "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{m}}} {stats.kv_cache_usage}",
                "# HELP revolta:kv_cache_free_blocks Free KV cache blocks (prefix-cached ones included).",
                "# TYPE revolta:kv_cache_free_blocks gauge",
                f"revolta:kv_cache_free_blocks{{{m}}} {stats.num_free_blocks}",
                "# HELP revolta:async_scheduled_steps_total Decode steps planned and launched before the previous "
                "step's tokens were read (--async-scheduling).",
                "# TYPE revolta:async_scheduled_steps_total counter",
                f"revolta:async_scheduled_steps_total{{{m}}} {stats.async_steps}",
                "# HELP vllm:cache_config_info Information of the KV cache configuration.",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{{m},block_size="{stats.block_size}",'
                f'enable_prefix_caching="{stats.prefix_caching}"}} 1',
                "# HELP vllm:prompt_tokens_total Prompt tokens of requests that reached the engine.",
                "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{{{m}}} {self.prompt_tokens}",
                "# HELP vllm:generation_tokens_total Generated tokens.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{m}}} {self.generation_tokens}",
                "# HELP vllm:request_success_total Requests that left the engine, by reason.",
                "# TYPE vllm:request_success_total counter",
            ]
            for reason in ("stop", "length", "abort", "error"):
                lines.append(f'vllm:request_success_total{{{m},finished_reason="{reason}"}} {self.finished[reason]}')
            if stats.speculative:  # vLLM's speculative-decoding counter names
                for name, value, text in (
                        ("vllm:spec_decode_num_drafts_total", stats.num_spec_rounds, "Verify rounds."),
                        ("vllm:spec_decode_num_draft_tokens_total", stats.num_draft_tokens, "Draft tokens proposed."),
                        ("vllm:spec_decode_num_accepted_tokens_total", stats.num_accepted_tokens,
                         "Draft tokens accepted.")):
                    lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name}{{{m}}} {value}"]
                name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                lines += [f"# HELP {name} Rounds whose draft at this position was accepted.",
                          f"# TYPE {name} counter"]
                lines += [f'{name}{{{m},position="{j}"}} {n}' for j, n in enumerate(stats.accepted_per_position)]
                lines += _paused_lines(stats, m)
            for name, hist, text in (
                    ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                    ("vllm:inter_token_latency_seconds", self.itl, "Time between consecutive output steps."),
                    ("vllm:e2e_request_latency_seconds", self.e2e, "Arrival to finish of completed requests.")):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram", *hist.lines(name, m)]
        return "\n".join(lines) + "\n"


def _paused_lines(stats: EngineStats, m: str) -> list[str]:
    """The adaptive drafting policy (engine/spec_policy.py): whether drafting is paused, for how many steps,
    and why (its estimated speedup of drafting over plain decoding; below 1 it pauses)."""
    lines = ["# HELP revolta:spec_decode_paused 1 while speculative drafting is paused because it does not pay at "
             "the current batch size (estimated speedup below 1), else 0.",
             "# TYPE revolta:spec_decode_paused gauge", f"revolta:spec_decode_paused{{{m}}} {int(stats.spec_paused)}",
             "# HELP revolta:spec_decode_paused_steps_total Decode steps run without drafting by the policy's choice.",
             "# TYPE revolta:spec_decode_paused_steps_total counter",
             f"revolta:spec_decode_paused_steps_total{{{m}}} {stats.spec_paused_steps}"]
    if stats.spec_speedup is not None:
        lines += ["# HELP revolta:spec_decode_estimated_speedup Measured tokens/s with drafting over plain decoding "
                  "at the current batch size (drafting pauses below 1).",
                  "# TYPE revolta:spec_decode_estimated_speedup gauge",
                  f"revolta:spec_decode_estimated_speedup{{{m}}} {stats.spec_speedup:.4f}"]
    return lines
