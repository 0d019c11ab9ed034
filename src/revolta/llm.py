"""LLM: the offline entry point, with vLLM's call shapes.

    llm = LLM()                                   # the embedded default model, offline (also LLM("default"))
    llm = LLM(model="/path/to/checkpoint")
    outs = llm.generate(["Hello", {"prompt_token_ids": [9707]}], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

`LLM` is a thin front over the engine (engine/): it loads the checkpoint and tokenizer, turns prompts
into engine `Request`s (tokenized, media decoded and placed, seeded, with their grammar), and outputs
back into vLLM-shaped `RequestOutput`s; `generate`, `stream` and `chat` drive the engine to the end,
`add_request` / `step` / `abort_request` let a server drive it one step at a time; `sleep` / `wake_up` and
`pause` / `resume` (llm_sleep.py) free the device or hold generation between steps. Scheduling, the paged
cache, sampling and stop rules are the engine's: a request's tokens do not depend on the rest of the
batch (greedy rows are argmax, sampled rows use their own generator).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

import torch

from .config import ModelConfig
from .engine import EngineStatus
from .engine.request import Request, RequestMetrics, RequestOutput
from .engine.sampling import SamplingParams, make_generator
from .engine.structured import (RequestConstraint, StructuredDecoding, compact_json_default, prompt_opens_reasoning,
                                 reasoning_ids)
from .llm_config import (check_engine_args, engine_config, effective_config, load_tokenizer, log_summary,
                         read_checkpoint_json, resolve_device, resolve_dtype)
from .llm_load import build_engine, requested_max_model_len, resolve_llm_speculation, resolve_parallel
from .llm_sleep import SleepPauseMixin
from .model import FlashNextModel, has_mtp_weights, load_model
from .multimodal.footprint import MediaFootprint, media_footprint
from .multimodal.processor import MediaConfig, MultimodalPrompt, parse_limits, process_multimodal_prompt
from .multimodal.sources import media_from_messages, template_messages
from .ple.placement import resolve_ple_placement
from .presets.load import resolve_model
from .progress import GenerationBar
from .tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

# "text", {"prompt": "text"} or {"prompt_token_ids": [...]}, optionally with "multi_modal_data":
# {"image": [...], "video": ...} and "mm_processor_kwargs" (see multimodal/processor.py)
PromptType = Union[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt after `LLM.process_prompt`: tokenized, its media decoded and placed. Also a valid prompt.

    prompt_token_ids are final: each media item's placeholder is expanded to one pad per vision-tower output row,
    so their count is what the request costs in the context (and what usage reports).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    mm_prompt: MultimodalPrompt | None = None


class LLM(SleepPauseMixin):
    """Load a checkpoint (or the embedded default) and generate from prompts, vLLM-style.

    Args:
        model: checkpoint directory (config.json, *.safetensors, tokenizer.json, ...); None or "default" = the
            embedded default preset, built offline into the cache on first use.
        tokenizer: directory with tokenizer.json when the checkpoint has none.
        dtype: "auto" (float32 on CPU, float16 on CUDA), "float32", "float16", "bfloat16" or a torch dtype.
        device: None = cuda when available, else cpu.
        seed: seeds the per-request generators of requests that have no `SamplingParams.seed`.
        max_model_len: longest prompt + output in tokens; default the model's max_position_embeddings, lowered (with
            a warning) to what the KV cache holds for one sequence when that is less.
        **engine_args: other vLLM `LLM` arguments (see llm_config.ENGINE_ARG_NAMES); unknown names raise TypeError.
    """

    def __init__(self, model: str | Path | None = None, *, tokenizer: str | Path | None = None,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, seed: int = 0,
                 max_model_len: int | None = None, **engine_args: Any):
        check_engine_args(engine_args, seed)
        self.compact_json = compact_json_default(engine_args.get("structured_outputs_config"))  # checked before loading
        start = time.perf_counter()
        self.device = resolve_device(device)  # before the default is built: a missing device fails at once
        self.model_path, self.is_default_model = resolve_model(model)
        self.dtype = resolve_dtype(dtype, self.device)
        self.cfg = target = ModelConfig.from_pretrained(self.model_path)
        self.mtp_weights = has_mtp_weights(self.model_path, target)  # MTP4 is the default only with them
        self.speculative_config = resolve_llm_speculation(
            engine_args.get("speculative_config"), target, self.model_path, is_default=self.is_default_model,
            mtp_weights=self.mtp_weights, dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto"),
            tensor_parallel_size=engine_args.get("tensor_parallel_size", 1))
        self.ple_placement = resolve_ple_placement(engine_args.get("ple_placement"))
        if self.ple_placement.source != "default":
            logger.info("PLE table placement %r from the %s", self.ple_placement.value, self.ple_placement.source)
        # before any weight is read: the layout, the engine's settings, the tokenizer and the media limits
        self.parallel = resolve_parallel(engine_args, target, self.device)
        planned_len, fit_len = requested_max_model_len(max_model_len, target)
        config = engine_config(engine_args, self.device, planned_len, self.speculative_config, target, fit_len)
        self.tokenizer = load_tokenizer(self.model_path, tokenizer, engine_args.get("skip_tokenizer_init", False))
        self.mm_limits = parse_limits(engine_args.get("limit_mm_per_prompt"))
        self.media_config = MediaConfig().updated(engine_args.get("mm_processor_kwargs"))
        with_mtp = self.speculative_config.method == "mtp"
        # at tp > 1 build_engine loads rank 0's shard (its slices only) instead of the full model
        model = None if self.parallel.tp > 1 else load_model(self.model_path, dtype=self.dtype, device=self.device,
                                                              with_mtp=with_mtp, progress=not self.is_default_model,
                                                              ple_placement=self.ple_placement.value)
        eos = {self.cfg.text.eos_token_id}
        if self.tokenizer is not None:
            eos.update(self.tokenizer.stop_token_ids)
        self.generation_config = read_checkpoint_json(self.model_path, "generation_config.json")
        self.engine_args = dict(engine_args)
        self.allowed_local_media_path = engine_args.get("allowed_local_media_path")
        self._explicit = {"dtype": dtype != "auto", "device": device is not None, "seed": seed != 0,
                          "max_model_len": max_model_len is not None}
        # embedding rows past the tokenizer's ids are padding with no text; the engine never samples them
        num_text_ids = self.tokenizer.vocab_size if self.tokenizer is not None else self.cfg.text.vocab_size
        self.engine = build_engine(model, config, self.model_path, target, self.dtype, with_mtp,
                                   tokenizer=self.tokenizer, eos_token_ids=frozenset(eos),
                                   num_text_ids=num_text_ids, ple_placement=self.ple_placement.value,
                                   device=self.device)
        self.model: FlashNextModel = self.engine.model  # at tp > 1: rank 0's shard
        # every row count of a speculative round (and a prefill) compiled now, not inside a user's first requests
        self.warmup = self.engine.warm_up() if self.engine.config.use_warmup else None
        self.max_model_len = self.engine.config.max_model_len  # the checkpoint's may be lowered to fit the cache
        self._structured: StructuredDecoding | None = None  # built by the first structured request
        self._seed, self._seed_rng = seed, random.Random(seed)
        self._next_request_id = 0
        self._live: dict[str, list[Request]] = {}  # request id -> its n completions, while running
        log_summary(self, time.perf_counter() - start)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a request (unless ignore_eos): the model's eos_token_id and the tokenizer's stop tokens."""
        return self.engine.sampler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.engine.sampler.eos_token_ids = frozenset(ids)

    # ---- setup -------------------------------------------------------------------------------
    def effective_config(self) -> list[tuple[str, Any, str]]:
        """(name, value, source) of every engine setting in force; source is "argument",
        "environment", "checkpoint" or "default" (with how a default was resolved)."""
        return effective_config(self)

    # ---- public API ----------------------------------------------------------------------------
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config.json (as vLLM does), else the defaults."""
        gc = self.generation_config
        kwargs = {k: gc[k] for k in ("temperature", "top_p", "top_k", "min_p") if gc.get(k) is not None}
        if gc.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        if gc.get("max_new_tokens") is not None:
            kwargs["max_tokens"] = gc["max_new_tokens"]
        return SamplingParams(**kwargs)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate a completion for each prompt; results come back in prompt order.

        prompts: a string, {"prompt": str}, {"prompt_token_ids": [int, ...]}, or a list of those; a dict may add
            "multi_modal_data": {"image": [PIL image | bytes | path | data: URL, ...], "video": path | bytes |
            [F, H, W, 3] uint8 frames} with one `<|image_pad|>` / `<|video_pad|>` per item in the prompt, and
            "mm_processor_kwargs" (min_pixels, max_pixels, fps, num_frames, ...), or a `process_prompt` result.
            Bad media raise MediaError.
        sampling_params: one for all prompts, one per prompt, or None (the checkpoint's generation_config).
        """
        requests = self._make_requests(prompts, sampling_params)
        with GenerationBar(requests, self.max_model_len, enabled=use_tqdm) as bar:  # moves every step
            for changed in self._run(requests):
                bar.update(changed)
        outputs: list[RequestOutput] = []
        for r in requests:  # the n completions of a prompt are consecutive
            if r.index == 0:
                outputs.append(r.output())
            else:
                outputs[-1].outputs.append(r.completion())
                outputs[-1].metrics.num_generation_tokens += len(r.token_ids)
        return outputs

    def stream(self, prompts: PromptType | Sequence[PromptType],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Like `generate`, but yield a RequestOutput (cumulative text and tokens) each time a request
        gains a token; the last one for each request has `finished=True`. Use `request_id` to tell them apart."""
        requests = self._make_requests(prompts, sampling_params)
        for changed in self._run(requests):
            yield from (r.output() for r in changed)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool = True,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             mm_processor_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Render one conversation (a list of {role, content} messages) or a list of conversations with the
        checkpoint's chat template and generate a reply for each.

        Content may be a list of parts: text, and images / videos as OpenAI `image_url` / `video_url` parts
        (base64 `data:` URLs or local files) or `{"type": "image", "image": PIL image | path | bytes}` and
        `{"type": "video", "video": path | bytes | frames}` (see `mm_processor.media_from_messages`).
        continue_final_message=True continues the final assistant message (prefill; `render_chat_template`)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        template = {"tools": tools, "enable_thinking": enable_thinking, "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    **dict(chat_template_kwargs or {})}  # vLLM callers pass enable_thinking there: it wins
        prompts = [self.chat_prompt(c, mm_processor_kwargs=mm_processor_kwargs, **template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], allow_local_files: bool = True,
                    mm_processor_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> PromptType:
        """The prompt `chat` generates from: the rendered text, plus `multi_modal_data` when the messages hold
        images or videos. `allow_local_files=False` (the server) refuses file paths and `file://` URLs outside
        `allowed_local_media_path`. Bad media raise `MediaError` (a ValueError) before anything is queued."""
        media = media_from_messages(messages, self.allowed_local_media_path, allow_local_files)
        text = self.render_chat(messages, **kwargs)
        if not media["image"] and not media["video"]:
            return text
        return {"prompt": text, "multi_modal_data": media, "mm_processor_kwargs": dict(mm_processor_kwargs or {})}

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt text `chat` would generate from (tools=, enable_thinking=, ... as in `chat`)."""
        return self._require_tokenizer("chat").apply_chat_template(template_messages(messages), **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, but {self.model_path} has none; pass tokenizer=DIR or "
                             "use {'prompt_token_ids': [...]} prompts")
        return self.tokenizer

    def _make_requests(self, prompts: PromptType | ProcessedPrompt | Sequence[PromptType | ProcessedPrompt],
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[Request]:
        if isinstance(prompts, (str, Mapping, ProcessedPrompt)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, Mapping)):  # a dict is reported below, not read as a list
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params; pass one "
                                 "SamplingParams for all or one per prompt")
        for sp in params_list:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sp).__name__}; "
                                "build one with SamplingParams(**fields)")
        arrival = time.time()
        requests: list[Request] = []
        try:
            for p, sp in zip(prompts, params_list):
                processed = self.process_prompt(p)  # n > 1: the siblings share the decoded media
                first = self._make_request(processed, sp, arrival)
                requests.append(first)
                for i in range(1, sp.n):  # n > 1: siblings share the prompt (and its prefix-cache blocks)
                    sib = self._make_request(processed, sp, arrival, seed_offset=i)
                    sib.index, sib.parent_id = i, first.request_id
                    requests.append(sib)
        except Exception:  # nothing is queued: drop the matchers already opened
            for r in requests:
                r.release()
            raise
        return requests

    def process_prompt(self, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
        """Tokenize `prompt` and load, check and place its media, queuing nothing: the first half of add_request.

        `len(result.prompt_token_ids)` counts every media pad token. Passing the result to add_request or
        generate skips this work there; the server runs it on a worker thread so that decoding images does not
        stall the engine thread. It reads only configuration, so it may run while `step()` runs on another
        thread. A bad prompt raises ValueError (MediaError for bad media) or TypeError.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, ids = self._prompt_ids(prompt)
        vocab = self.cfg.text.vocab_size
        if not ids:
            raise ValueError("a prompt is empty; give at least one token")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]}, outside the vocabulary [0, {vocab})")
        mm = self._multimodal(prompt, ids)
        if mm is not None:
            self.engine.check_media(mm)
            ids = mm.token_ids  # one pad per vision-tower output row
        return ProcessedPrompt(text, ids, mm)

    def _make_request(self, prompt: ProcessedPrompt, params: SamplingParams, arrival: float,
                      seed_offset: int = 0) -> Request:
        text, ids = prompt.prompt, list(prompt.prompt_token_ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len={self.max_model_len} leaves no "
                             "room to generate; shorten the prompt or raise max_model_len")
        seed = params.seed + seed_offset if params.seed is not None else self._seed_rng.getrandbits(63)
        generator = None if params.greedy else make_generator(seed, self.device)
        detok = (None if self.tokenizer is None or not params.detokenize
                 else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
        while str(self._next_request_id) in self._live:  # skip ids a caller chose in add_request
            self._next_request_id += 1
        request_id, self._next_request_id = str(self._next_request_id), self._next_request_id + 1
        return Request(request_id, ids, params, generator, detokenizer=detok, prompt=text,
                       metrics=RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids)),
                       mm_prompt=prompt.mm_prompt, constraint=self._constraint(params, ids))

    def _constraint(self, params: SamplingParams, prompt_ids: list[int]) -> RequestConstraint | None:
        """The request's grammar matcher and reasoning budget (structured.py), or None when unconstrained."""
        if not params.constrained:
            return None
        spec = params.structured_outputs
        if spec is not None:
            self._require_tokenizer("structured_outputs")
            if self.compact_json and not spec.disable_any_whitespace:  # LLM(structured_outputs_config=...)
                spec = replace(spec, disable_any_whitespace=True)
        think_start, think_end = reasoning_ids(self.tokenizer)
        if params.thinking_token_budget is not None and think_end is None:
            raise ValueError("thinking_token_budget needs a tokenizer with a </think> token; drop it for this model")
        return RequestConstraint(self.structured_decoding() if spec is not None else None, spec,
                                 prompt_opens_reasoning(prompt_ids, think_start, think_end), think_end,
                                 params.thinking_token_budget)

    def structured_decoding(self) -> StructuredDecoding:
        """The grammar compiler and its cache for this model's tokenizer (built on first use; needs xgrammar)."""
        if self._structured is None:
            tok = self._require_tokenizer("structured_outputs")
            self._structured = StructuredDecoding(tok, self.cfg.text.vocab_size, sorted(self.eos_token_ids))
        return self._structured

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer("a text prompt").encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(i) for i in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self._require_tokenizer("a text prompt").encode(prompt["prompt"])
        raise TypeError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                        f"got {prompt!r:.80}")

    def _multimodal(self, prompt: PromptType, ids: list[int]) -> MultimodalPrompt | None:
        """Load and place the prompt's media (None for a text prompt); bad media raise MediaError."""
        if not isinstance(prompt, Mapping) or not prompt.get("multi_modal_data"):
            return None
        media = self.media_config.updated(prompt.get("mm_processor_kwargs"))
        tok = self.tokenizer
        timestamps = None if tok is None else (lambda seconds: tok.encode(f"<{seconds:.1f} seconds>"))
        return process_multimodal_prompt(ids, prompt["multi_modal_data"], self.cfg, media, self.mm_limits,
                                         timestamps, self.allowed_local_media_path)

    def media_footprint(self, prompt: PromptType) -> MediaFootprint | None:
        """The host memory the prompt's media take to decode and to keep, priced from their headers (None for a
        text prompt; see multimodal/footprint.py). Reads only configuration, like `process_prompt`."""
        if not isinstance(prompt, Mapping) or not prompt.get("multi_modal_data"):
            return None
        return media_footprint(prompt["multi_modal_data"], self.cfg, self.media_config.updated(
            prompt.get("mm_processor_kwargs")), self.mm_limits, self.allowed_local_media_path)

    # ---- incremental API (the server drives the engine with these) -------------------------------
    def add_request(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt (or a `process_prompt` result) for `step()`; returns its request id (generated when
        not given).

        With `sampling_params.n > 1` the n completions run as siblings under this one id. The prompt is
        validated here: a bad prompt raises (ValueError / TypeError) and nothing is queued.
        """
        if request_id is not None and (request_id in self._live or not isinstance(request_id, str)):
            raise ValueError(f"request_id {request_id!r} is already in use or not a string; pass a new one")
        requests = self._make_requests(prompt, sampling_params)  # validates before anything is queued
        rid = request_id or requests[0].request_id
        for r in requests:
            if request_id is not None:
                r.parent_id = request_id
            self.engine.add_request(r)
        self._live[rid] = requests
        return rid

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its n completions) now and free its cache blocks; unknown ids are ignored."""
        for r in self._live.pop(request_id, ()):
            self.engine.abort(r.request_id)
            r.release()  # also for a request the engine already finished or never saw

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def check_health(self) -> None:
        """Raise a FatalEngineError when the engine cannot run again (e.g. its PLE worker process died)."""
        self.engine.check_health()

    def close(self) -> None:
        """Stop the engine's worker processes (the tensor-parallel ranks, PLE workers), bounded; generate no more
        after it."""
        self.engine.close()

    def engine_stats(self) -> EngineStatus:
        """Queue lengths, KV-cache usage and speculation counters of the engine (the server's /metrics)."""
        return self.engine.stats()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step (one forward over every scheduled request).

        Returns one RequestOutput per completion that gained a token: cumulative text and token ids,
        `outputs[0].index` says which of the n completions it is, `finished=True` on its last one.
        """
        return [r.output() for r in self._step()]

    def _step(self) -> list[Request]:
        stepped = self.engine.step()
        for rid in [rid for rid, group in self._live.items() if all(r.finished for r in group)]:
            del self._live[rid]
        return stepped

    # ---- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Feed the requests to the engine (continuous batching on the paged cache) until all finish.

        Yields the requests that gained a token, after each step.
        """
        groups: dict[str, list[Request]] = {}
        for r in requests:
            groups.setdefault(r.parent_id or r.request_id, []).append(r)
        for r in requests:
            self.engine.add_request(r)
        self._live.update(groups)
        try:
            while any(not r.finished for r in requests):
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine has no work left but requests are unfinished")
                stepped = self._step()
                if stepped:
                    yield stepped
        finally:  # an exception or an abandoned stream frees every cache block the requests hold
            for rid in groups:
                self.abort_request(rid)
