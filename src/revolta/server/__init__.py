"""revolta's reference server: OpenAI- and Anthropic-compatible HTTP API on top of `revolta.LLM`.

    revolta serve [MODEL] --host 127.0.0.1 --port 8000

`build_app(llm, ServerConfig(...))` gives the FastAPI app; `run_server` runs it under uvicorn. The
contract is ../shared/spec/server.md; the layout: app (wiring), engine_loop (the LLM's thread),
errors / middleware (envelopes, auth), params / protocol / chat_prompt (validation, prompts),
output (reasoning and tool-call splitting), one module per route family, sse, metrics.
"""

from .config import ServerConfig

__all__ = ["ServerConfig"]
