"""ServerConfig: what `revolta serve` was asked to do (HTTP side; engine and media arguments go to LLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_KEEP_ALIVE_S = 10.0  # well under the common 50-60 s proxy idle timeouts, even during a long prefill
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
MAX_N = 128  # OpenAI's documented maximum of `n`: each choice is its own request in the engine
DEFAULT_MAX_BODY_BYTES = 32 * 2**20  # Anthropic's cap on a Messages request body


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of the reference server.

    served_model_name: the one name clients must use (an empty/omitted model on OpenAI routes selects it).
    api_key: when set, every route but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
    sse_keep_alive_interval: seconds of silence before a `: keep-alive` comment on a stream (0 = off).
    tool_call_parser / reasoning_parser: "qwen3_coder" / "qwen3", or None to leave model text unparsed.
    max_body_bytes: larger request bodies are refused with 413.
    max_n: the most choices (`n`) one request may ask for; more is a 400 naming `n` (each choice is a request in
        the engine, so an unbounded n would queue without limit from one call).
    max_pending_requests: most requests in the engine at once (running + queued); more are refused
        at once with 503 and Retry-After instead of queueing without bound (None = no limit).
    enable_dev_endpoints: serve /sleep, /wake_up, /is_sleeping, /pause, /resume, /is_paused (dev_routes.py).
    structured_disable_any_whitespace: JSON outputs (response_format, text.format, structured_outputs)
        get compact separators instead of free whitespace unless a request says otherwise.
    max_media_memory_gib: the budget of decoded media bytes in flight (media_budget.py); None = a quarter of
        MemAvailable at startup.
    media_wait_timeout_s: how long a request waits for media budget before a 503 with Retry-After.
    """

    served_model_name: str
    served_model_aliases: tuple[str, ...] = ()  # vLLM's further --served-model-name names: accepted, not reported
    model_path: str = ""
    max_model_len: int = 0
    api_key: str | None = None
    sse_keep_alive_interval: float = DEFAULT_KEEP_ALIVE_S
    tool_call_parser: str | None = "qwen3_coder"
    reasoning_parser: str | None = "qwen3"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_stop_strings: int = MAX_STOP_STRINGS
    max_n: int = MAX_N
    max_pending_requests: int | None = None
    structured_disable_any_whitespace: bool = False  # --structured-outputs-config {"disable_any_whitespace": ...}
    enable_dev_endpoints: bool = False
    max_media_memory_gib: float | None = None
    media_wait_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if not all(self.served_model_aliases):
            raise ValueError("--served-model-name: every name must be a non-empty string")
        if self.sse_keep_alive_interval < 0:
            raise ValueError(f"--sse-keep-alive-interval={self.sse_keep_alive_interval} must be >= 0 (0 = off)")
        if self.tool_call_parser not in (None, "qwen3_coder"):
            raise ValueError(f"--tool-call-parser={self.tool_call_parser!r} is not supported; use qwen3_coder")
        if self.reasoning_parser not in (None, "qwen3"):
            raise ValueError(f"--reasoning-parser={self.reasoning_parser!r} is not supported; use qwen3")
        if self.max_pending_requests is not None and self.max_pending_requests < 1:
            raise ValueError(f"--max-pending-requests={self.max_pending_requests} must be >= 1")
        if self.max_media_memory_gib is not None and not self.max_media_memory_gib > 0:
            raise ValueError(f"--max-media-memory-gib={self.max_media_memory_gib} must be > 0; it bounds the decoded "
                             "image and video bytes held at once (omit it for a quarter of MemAvailable)")
        if not self.media_wait_timeout_s >= 0:
            raise ValueError(f"--media-wait-timeout={self.media_wait_timeout_s} must be >= 0 seconds")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may use; the first is the one responses report."""
        return (self.served_model_name, *self.served_model_aliases)

    def describe(self) -> dict[str, Any]:
        """The settings for the startup log, without the key."""
        return {"served_model_name": self.served_model_name,
                **({"served_model_aliases": self.served_model_aliases} if self.served_model_aliases else {}),
                "max_model_len": self.max_model_len,
                "api_key": "set" if self.api_key else None, "sse_keep_alive_interval": self.sse_keep_alive_interval,
                "tool_call_parser": self.tool_call_parser, "reasoning_parser": self.reasoning_parser}
