"""A stand-in for `revolta.LLM` behind the server, for the tool-call and reasoning checks.

The embedded default model has random weights, so it never writes a `<tool_call>`. `ScriptedLLM`
has the same public surface the server uses (add_request / step / abort_request /
has_unfinished_requests, chat_prompt, get_tokenizer, ...) and the real tokenizer and chat template,
but each request generates the next scripted text (one per sample with n > 1), one token per step.
Everything between the HTTP request and these outputs (rendering, validation, parsing, SSE, the SDKs)
is the real server.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from revolta.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from revolta.engine.sampling import SamplingParams
from revolta.tokenizer import Tokenizer


class ScriptedLLM:
    def __init__(self, model_dir: Path, max_model_len: int = 4096, step_delay: float = 0.0):
        self.model_path = Path(model_dir)
        self.max_model_len = max_model_len
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        self.scripts: deque[str] = deque()  # the texts the next requests will generate, in order
        self.prompts: list[list[int]] = []  # every accepted prompt, for assertions
        self.sampling_params: list[SamplingParams] = []  # and its SamplingParams
        self._live: dict[str, tuple[list[int], list[int], SamplingParams, RequestMetrics]] = {}
        self._done: dict[str, int] = {}  # tokens generated so far, per request
        self.step_delay = step_delay  # seconds per step, to keep requests in flight

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def render_chat(self, messages, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def chat_prompt(self, messages, allow_local_files=True, **kwargs) -> str:
        if any(isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"])
               for m in messages):
            raise ValueError("ScriptedLLM takes text only; media tests use the real LLM (test_media.py)")
        return self.render_chat(messages, **kwargs)

    def add_request(self, prompt, sampling_params: SamplingParams, request_id: str) -> str:
        if not self.scripts:
            raise RuntimeError("ScriptedLLM: no script queued for this request")
        ids = list(prompt["prompt_token_ids"])
        self.prompts.append(ids)
        self.sampling_params.append(sampling_params)
        if len(self.scripts) < sampling_params.n:
            raise RuntimeError(f"ScriptedLLM: n={sampling_params.n} needs as many scripts, {len(self.scripts)} queued")
        # one script per sample, in index order
        scripts = [self.tokenizer.encode(self.scripts.popleft()) for _ in range(sampling_params.n)]
        metrics = RequestMetrics(time.time(), num_prompt_tokens=len(ids))
        self._live[request_id] = (ids, scripts, sampling_params, metrics)
        self._done[request_id] = 0
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        outputs = []
        for rid, (ids, scripts, params, metrics) in list(self._live.items()):
            k = self._done[rid] = self._done[rid] + 1
            ends = [max(1, min(len(script), params.max_tokens or len(script))) for script in scripts]
            for index, (script, end) in enumerate(zip(scripts, ends)):
                if k > end:  # this sample finished on an earlier step
                    continue
                finish = None if k < end else "stop" if k >= len(script) else "length"
                text = self.tokenizer.decode(script[:k], skip_special_tokens=True)
                outputs.append(RequestOutput(rid, None, ids, [CompletionOutput(index, text, script[:k],
                                                                               finish_reason=finish)],
                                             finished=finish is not None, metrics=metrics))
            if k >= max(ends):
                del self._live[rid]
        return outputs
