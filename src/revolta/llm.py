"""LLM: the offline entry point, with vLLM's call shapes.

    llm = LLM()                                   # the embedded default model, offline
    llm = LLM(model="/path/to/checkpoint")
    outs = llm.generate(["Hello", {"prompt_token_ids": [9707]}], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

This issue's generation path is a plain batched loop over the model's incremental API: one
`SequenceState` per request, one flat varlen prefill of every prompt, then one decode step per token
over the still-running requests. It has no scheduler, no paged cache and no CUDA graphs (the engine
comes later); what it guarantees already is that a request's tokens do not depend on the rest of the
batch (greedy rows are argmax, sampled rows use their own generator).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .config import ModelConfig
from .engine import Engine, EngineConfig
from .multimodal.sources import media_from_messages
from .multimodal.processor import MediaConfig, MultimodalPrompt, parse_limits, process_multimodal_prompt
from .model import FlashNextModel, load_model
from .ple.load import ple_memory
from .ple.placement import resolve_ple_placement
from .engine.request import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .engine.sampling import Sampler, SamplingParams, apply_penalties, compute_logprobs, make_generator
from .spec.config import DFLASH2_METHODS, SpeculativeConfig
from .spec.dflash2.checks import check_dflash2, check_pipeline_parallel
from .spec.stats import SpecStats
from .spec.verify import greedy_accept, rejection_sample
from .engine.structured import (RequestConstraint, StructuredDecoding, apply_row_constraints,
                                prompt_opens_reasoning, reasoning_ids)
from .tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

logger = logging.getLogger(__name__)

# "text", {"prompt": "text"} or {"prompt_token_ids": [...]}, optionally with "multi_modal_data":
# {"image": [...], "video": ...} and "mm_processor_kwargs" (see mm_processor.py)
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

# vLLM `LLM(...)` / `vllm serve` names that revolta accepts. Those not in _USED are recorded for the engine of a
# later issue and do not change this generation path (the startup log says so).
ENGINE_ARG_NAMES = frozenset({
    "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "revision", "tokenizer_revision",
    "download_dir", "load_format", "quantization", "tensor_parallel_size", "pipeline_parallel_size",
    "gpu_memory_utilization", "swap_space", "cpu_offload_gb", "max_num_seqs", "max_num_batched_tokens",
    "kv_cache_dtype", "block_size", "enable_prefix_caching", "enforce_eager", "speculative_config",
    "limit_mm_per_prompt", "max_logprobs", "disable_log_stats", "generation_config", "compilation_config",
    "mm_processor_kwargs", "allowed_local_media_path",
    # revolta's own engine knobs (EngineConfig)
    "kv_cache_gib", "kv_offload_gib", "cudagraph_mem_mib", "cudagraph_capture_sizes",
    "max_num_encoder_input_tokens", "encoder_cache_size",
    "ple_placement",  # where the PLE n-gram table lives: "device", "host" or "disk" (ple/placement.py)
})
_LOAD_ARGS = ("ple_placement",)  # arguments that shape how the weights load
# vLLM arguments the media path consumes (mm_processor.py)
_MEDIA_ARGS = ("limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path")
# arguments the engine consumes (the rest are accepted for compatibility and logged)
_ENGINE_CONFIG_ARGS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "enable_prefix_caching",
                       "gpu_memory_utilization", "block_size", "enforce_eager", "kv_cache_gib", "kv_offload_gib",
                       "cudagraph_mem_mib", "cudagraph_capture_sizes", "max_num_encoder_input_tokens",
                       "encoder_cache_size", "speculative_config")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> float32 on CPU, float16 on CUDA (the V100 path has no bf16); else a name or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto', 'float32', 'float16' or 'bfloat16'")
    return _DTYPES[dtype]


def _check_engine_args(engine_args: Mapping[str, Any]) -> None:
    for name in engine_args:
        if name not in ENGINE_ARG_NAMES:
            known = sorted(ENGINE_ARG_NAMES) + ["tokenizer", "dtype", "device", "seed", "max_model_len"]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unknown engine argument {name!r}{hint} "
                            f"(accepted vLLM names: {', '.join(sorted(ENGINE_ARG_NAMES))})")
    spec = engine_args.get("speculative_config")
    if isinstance(spec, Mapping) and spec.get("method") in DFLASH2_METHODS:
        check_pipeline_parallel(engine_args.get("pipeline_parallel_size", 1))  # a DFlash2 limit, not a "yet"
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if engine_args.get(name, 1) != 1:
            raise ValueError(f"{name}={engine_args[name]}: only 1 is supported by this generation path yet")


@dataclass
class _Request:
    """One prompt being generated: its state, its output so far, and its stop rules."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    max_tokens: int  # resolved against max_model_len
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled by position as chunks run
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    index: int = 0  # which of the prompt's n completions this is
    parent_id: str | None = None  # the prompt's request id when n > 1
    mm_prompt: MultimodalPrompt | None = None  # media items, positions (prompt_token_ids are then expanded)
    spec_stats: SpecStats | None = None  # acceptance statistics (the engine records them) when speculating
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (the scheduler sets it)
    constraint: RequestConstraint | None = None  # grammar / thinking budget (structured.py), until it finishes

    def __post_init__(self) -> None:
        self.stop_checker = StopChecker(self.params.stop_strings, self.params.include_stop_str_in_output)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, eos_token_ids: frozenset[int]) -> None:
        """Record one sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        allowed = self.constraint is None or self.constraint.accept(token_id)
        if self.detokenizer is not None:
            self.text += self.stop_checker.feed(self.detokenizer.add(token_id))
        if self.stop_checker.finished:
            self._finish("stop", self.stop_checker.stop)
        elif not allowed:  # cannot happen with masked logits; end rather than emit outside the grammar
            logger.warning("request %s: token %d is outside its grammar; ending it", self.request_id, token_id)
            self._finish("stop", None)
        elif self.constraint is not None and self.constraint.terminated:  # the grammar is complete
            self._finish("stop", None if token_id in eos_token_ids else token_id)
        elif token_id in eos_token_ids and not self.params.ignore_eos:
            self._finish("stop", None)
        elif token_id in self.params.stop_token_ids:
            self._finish("stop", token_id)
        elif len(self.token_ids) >= self.max_tokens:
            self._finish("length", None)

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.release()
        if self.detokenizer is not None and not self.stop_checker.finished:
            self.text += self.stop_checker.feed(self.detokenizer.flush())
            self.text += self.stop_checker.flush()
            if self.stop_checker.finished:  # the held-back tail completed a stop string
                self.stop_reason = self.stop_checker.stop
        self.metrics.finished_time = time.time()

    def release(self) -> None:
        """Drop the grammar matcher (finished or aborted)."""
        if self.constraint is not None:
            self.constraint.close()
            self.constraint = None

    def output(self) -> RequestOutput:
        self.metrics.num_generation_tokens = len(self.token_ids)
        if self.spec_stats is not None:
            self.metrics.spec_decode = copy.deepcopy(self.spec_stats)
        return RequestOutput(self.parent_id or self.request_id, self.prompt, list(self.prompt_token_ids),
                             [self.completion()], finished=self.finished, metrics=self.metrics,
                             prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             num_cached_tokens=self.num_cached_tokens)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class LLM:
    """Load a checkpoint (or the embedded default) and generate from prompts, vLLM-style.

    Args:
        model: checkpoint directory (config.json, *.safetensors, tokenizer.json, ...); None = the embedded
            default preset, built offline into the cache on first use.
        tokenizer: directory with tokenizer.json when the checkpoint has none.
        dtype: "auto" (float32 on CPU, float16 on CUDA), "float32", "float16", "bfloat16" or a torch dtype.
        device: None = cuda when available, else cpu.
        seed: seeds the per-request generators of requests that have no `SamplingParams.seed`.
        max_model_len: longest prompt + output in tokens; default the model's max_position_embeddings.
        **engine_args: other vLLM `LLM` arguments (see ENGINE_ARG_NAMES); unknown names raise TypeError.
    """

    def __init__(self, model: str | Path | None = None, *, tokenizer: str | Path | None = None,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, seed: int = 0,
                 max_model_len: int | None = None, **engine_args: Any):
        _check_engine_args(engine_args)
        start = time.perf_counter()
        self.is_default_model = model is None
        if model is None:
            from .presets.default import ensure_default_model

            model = ensure_default_model()
        self.model_path = Path(model).expanduser()
        if not self.model_path.is_dir():
            raise FileNotFoundError(f"model={str(model)!r} is not a directory; pass a local checkpoint directory "
                                    "(config.json + *.safetensors), or no model for the embedded default")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # speculative decoding: MTP4 when the checkpoint has an MTP layer and no method is given
        target = ModelConfig.from_pretrained(self.model_path)
        spec_arg = engine_args.get("speculative_config")
        if self.is_default_model and isinstance(spec_arg, Mapping) and spec_arg.get("method") in DFLASH2_METHODS \
                and spec_arg.get("model") is None:  # the embedded default has an embedded drafter
            from .presets import ensure_default_drafter

            spec_arg = {**spec_arg, "model": str(ensure_default_drafter())}
        self.speculative_config = SpeculativeConfig.resolve(spec_arg,
                                                            target.text.mtp is not None)
        if self.speculative_config.is_dflash2:  # the DFlash2 checks run before any weight loads
            for warning in check_dflash2(self.speculative_config, target, dtype=str(self.dtype).removeprefix("torch."),
                                         kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto")):
                logger.warning(warning)
        self.ple_placement = resolve_ple_placement(engine_args.get("ple_placement"))
        if self.ple_placement.source != "default":
            logger.info("PLE table placement %r from the %s", self.ple_placement.value, self.ple_placement.source)
        self.model: FlashNextModel = load_model(self.model_path, dtype=self.dtype, device=self.device,
                                                with_mtp=self.speculative_config.method == "mtp",
                                                progress=not self.is_default_model,
                                                ple_placement=self.ple_placement.value)
        self.cfg: ModelConfig = self.model.cfg
        self.tokenizer = self._load_tokenizer(tokenizer, engine_args.get("skip_tokenizer_init", False))
        self.max_model_len = self._resolve_max_model_len(max_model_len)
        eos = {self.cfg.text.eos_token_id}
        if self.tokenizer is not None:
            eos.update(self.tokenizer.stop_token_ids)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # embedding rows past the tokenizer's ids are padding with no text; they are never sampled
        self._num_text_ids = self.tokenizer.vocab_size if self.tokenizer is not None else self.cfg.text.vocab_size
        self.generation_config = self._read_json("generation_config.json")
        self.engine_args = dict(engine_args)
        self.mm_limits = parse_limits(engine_args.get("limit_mm_per_prompt"))
        self.media_config = MediaConfig().updated(engine_args.get("mm_processor_kwargs"))
        self.allowed_local_media_path = engine_args.get("allowed_local_media_path")
        self._explicit = {"dtype": dtype != "auto", "device": device is not None, "seed": seed != 0,
                          "max_model_len": max_model_len is not None}
        self.engine = self._build_engine()
        self.sampler = Sampler()
        self._structured: StructuredDecoding | None = None  # built by the first structured request
        self._seed, self._seed_rng = seed, random.Random(seed)
        self._next_request_id = 0
        self._live: dict[str, list[_Request]] = {}  # request id -> its n completions, while running
        self._log_summary(time.perf_counter() - start)

    # ---- setup -------------------------------------------------------------------------------
    def _load_tokenizer(self, tokenizer: str | Path | None, skip: bool) -> Tokenizer | None:
        if skip:
            return None
        path = Path(tokenizer).expanduser() if tokenizer is not None else self.model_path
        if not (path / "tokenizer.json").is_file():
            if tokenizer is not None:
                raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} has no tokenizer.json")
            logger.warning("%s has no tokenizer.json: only {'prompt_token_ids': [...]} prompts work and outputs "
                           "have no text (pass tokenizer=DIR to fix)", self.model_path)
            return None
        return Tokenizer.from_pretrained(path)

    def _resolve_max_model_len(self, max_model_len: int | None) -> int:
        limit = self.cfg.text.max_position_embeddings
        if max_model_len is None:
            return limit
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be >= 2")
        if max_model_len > limit:
            logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d", max_model_len, limit)
        return int(max_model_len)

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.model_path / name
        return json.loads(path.read_text()) if path.is_file() else {}

    def _log_summary(self, seconds: float) -> None:
        t, v = self.cfg.text, self.cfg.vision
        num_params = sum(p.numel() for p in self.model.parameters())
        origin = "embedded default preset (random weights: output is not meaningful text)" \
            if self.is_default_model else "checkpoint"
        parts = [f"{t.num_hidden_layers} layers ({t.num_gdn_layers} GDN + {t.num_qsa_layers} QSA)",
                 f"MoE {t.num_experts} experts top-{t.num_experts_per_tok}",
                 f"MTP {t.num_mtp_layers}, speculative decoding {self.speculative_config.describe()}"
                 if t.num_mtp_layers else "no MTP",
                 f"vision {v.depth} blocks" if v is not None else "no vision"]
        logger.info("revolta: %s %s | %s on %s | %s | %.1fM params | ready in %.1f s", origin, self.model_path,
                    str(self.dtype).removeprefix("torch."), self.device, ", ".join(parts), num_params / 1e6, seconds)
        rows = self.effective_config()
        width = max(len(name) for name, _, _ in rows)
        logger.info("effective configuration (value [source]):\n%s", "\n".join(
            f"  {name:<{width}} {value!s:<24} [{source}]" for name, value, source in rows))
        unused = sorted(set(self.engine_args) - {"skip_tokenizer_init"} - set(_ENGINE_CONFIG_ARGS) - set(_MEDIA_ARGS)
                        - set(_LOAD_ARGS))
        if unused:
            logger.info("engine arguments recorded but not used by this generation path yet: %s", ", ".join(unused))

    def effective_config(self) -> list[tuple[str, Any, str]]:
        """(name, value, source) of every engine setting in force; source is "argument",
        "environment", "checkpoint" or "default" (with how a default was resolved)."""
        def arg(name: str) -> str:
            return "argument" if self._explicit.get(name) or name in self.engine_args else "default"

        ec = self.engine.config
        rows: list[tuple[str, Any, str]] = [
            ("model", self.model_path, "embedded default" if self.is_default_model else "argument"),
            ("dtype", str(self.dtype).removeprefix("torch."), arg("dtype") if self._explicit["dtype"]
             else f"default (auto on {self.device.type})"),
            ("device", self.device, arg("device") if self._explicit["device"] else "default (cuda if available)"),
            ("seed", self._seed, arg("seed")),
            ("max_model_len", self.max_model_len, "argument" if self._explicit["max_model_len"]
             else "checkpoint (max_position_embeddings)"),
        ]
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "enable_prefix_caching",
                     "gpu_memory_utilization", "kv_cache_gib", "kv_offload_gib", "block_size", "enforce_eager"):
            rows.append((name, getattr(ec, name), arg(name)))
        rows.append(("block_size (effective)", self.engine.plan.layout.block_size,
                     arg("block_size") if ec.block_size else "default (chosen for the model)"))
        rows.append(("kernels", ec.kernels, f"default for {self.device.type}"))
        graphs = self.engine.graphs or self.engine.spec_graphs
        if graphs is not None:
            rows.append(("cudagraph_capture_sizes", graphs.batch_sizes, arg("cudagraph_capture_sizes")))
            what = "speculative rounds (MTP draft steps, verify, commit)" if self.engine.spec_graphs else "decode steps"
            rows.append(("cuda graphs", f"{what}, {graphs.used_bytes / 2**20:,.0f} MiB", "captured at start-up"))
        else:
            why = "enforce_eager" if ec.enforce_eager else "no CUDA" if self.device.type != "cuda" else "torch kernels"
            rows.append(("cuda graphs", "off", why))
        mem_source = "argument" if ec.cudagraph_mem_mib is not None else \
            "environment (REVOLTA_CUDAGRAPH_MEM_MIB)" if "REVOLTA_CUDAGRAPH_MEM_MIB" in os.environ else \
            "default (1200 MiB with DFlash2, else 700 MiB)"
        rows.append(("cudagraph_mem_mib", ec.resolved_cudagraph_mem_mib(), mem_source))
        rows.append(("ple_placement", ple_memory(self.model).describe(), self.ple_placement.source))
        spec_source = arg("speculative_config") if "speculative_config" in self.engine_args else \
            f"default ({'MTP4: the checkpoint has an MTP layer' if self.cfg.text.mtp is not None else 'no MTP layer'})"
        rows.append(("speculative_config", self.speculative_config.describe(), spec_source))
        if self.engine.encoder_cache is not None:
            rows.append(("limit_mm_per_prompt", self.mm_limits, "argument" if "limit_mm_per_prompt" in self.engine_args
                         else "default (1 image, no video)"))
            rows.append(("max_num_encoder_input_tokens", self.engine.encoder_budget,
                         arg("max_num_encoder_input_tokens")))
            rows.append(("encoder_cache_size", self.engine.encoder_cache.capacity, arg("encoder_cache_size")))
        return rows

    def _build_engine(self) -> Engine:
        args = {name: self.engine_args[name] for name in _ENGINE_CONFIG_ARGS if name in self.engine_args}
        if "cudagraph_capture_sizes" in args:
            args["cudagraph_capture_sizes"] = tuple(args["cudagraph_capture_sizes"])
        args["speculative_config"] = self.speculative_config  # resolved against the checkpoint
        if self.device.type == "cpu":
            args.setdefault("max_num_seqs", 16)
        # the torch references are the CPU path; on a GPU the Triton kernels run the cache
        args["kernels"] = "triton" if self.device.type == "cuda" else "torch"
        return Engine(self.model, EngineConfig(max_model_len=self.max_model_len, **args))

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
        with tqdm(total=len(requests), desc="Generating", unit="seq", disable=not use_tqdm) as bar:
            for changed in self._run(requests):
                bar.update(sum(r.finished for r in changed))
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
             add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             mm_processor_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Render one conversation (a list of {role, content} messages) or a list of conversations with the
        checkpoint's chat template and generate a reply for each.

        Content may be a list of parts: text, and images / videos as OpenAI `image_url` / `video_url` parts
        (base64 `data:` URLs or local files) or `{"type": "image", "image": PIL image | path | bytes}` and
        `{"type": "video", "video": path | bytes | frames}` (see `mm_processor.media_from_messages`)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [self.chat_prompt(c, tools=tools, enable_thinking=enable_thinking,
                                    add_generation_prompt=add_generation_prompt,
                                    mm_processor_kwargs=mm_processor_kwargs, **dict(chat_template_kwargs or {}))
                   for c in conversations]
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
        return self._require_tokenizer("chat").apply_chat_template(messages, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, but {self.model_path} has none; pass tokenizer=DIR or "
                             "use {'prompt_token_ids': [...]} prompts")
        return self.tokenizer

    def _make_requests(self, prompts: PromptType | ProcessedPrompt | Sequence[PromptType | ProcessedPrompt],
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[_Request]:
        if isinstance(prompts, (str, Mapping, ProcessedPrompt)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params; pass one "
                                 "SamplingParams for all or one per prompt")
        for sp in params_list:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        arrival = time.time()
        requests: list[_Request] = []
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
                      seed_offset: int = 0) -> _Request:
        text, ids = prompt.prompt, list(prompt.prompt_token_ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len={self.max_model_len} leaves no "
                             "room to generate; shorten the prompt or raise max_model_len")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed + seed_offset if params.seed is not None else self._seed_rng.getrandbits(63)
        generator = None if params.greedy else make_generator(seed, self.device)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        while str(self._next_request_id) in self._live:  # skip ids a caller chose in add_request
            self._next_request_id += 1
        request_id, self._next_request_id = str(self._next_request_id), self._next_request_id + 1
        return _Request(request_id, text, ids, params, generator, max_tokens, detok,
                        RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids)),
                        mm_prompt=prompt.mm_prompt,
                        spec_stats=SpecStats() if self.speculative_config.enabled else None,
                        constraint=self._constraint(params, ids))

    def _constraint(self, params: SamplingParams, prompt_ids: list[int]) -> RequestConstraint | None:
        """The request's grammar matcher and reasoning budget (structured.py), or None when unconstrained."""
        if not params.constrained:
            return None
        spec = params.structured_outputs
        if spec is not None:
            self._require_tokenizer("structured_outputs")
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
            r.release()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def check_health(self) -> None:
        """Raise a FatalEngineError when the engine cannot run again (e.g. its PLE worker process died)."""
        self.engine.check_health()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step (one forward over every scheduled request).

        Returns one RequestOutput per completion that gained a token: cumulative text and token ids,
        `outputs[0].index` says which of the n completions it is, `finished=True` on its last one.
        """
        return [r.output() for r in self._step()]

    def _step(self) -> list[_Request]:
        now = time.time()
        for group in self._live.values():
            for r in group:
                if r.metrics.first_scheduled_time is None:
                    r.metrics.first_scheduled_time = now
        stepped = self.engine.step(self._sample_and_append, self._record_prompt_logprobs)
        now = time.time()
        for r in stepped:
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
        for rid in [rid for rid, group in self._live.items() if all(r.finished for r in group)]:
            del self._live[rid]
        return stepped

    # ---- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, requests: list[_Request]) -> Iterator[list[_Request]]:
        """Feed the requests to the engine (continuous batching on the paged cache) until all finish.

        Yields the requests that gained a token, after each step.
        """
        groups: dict[str, list[_Request]] = {}
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

    def _sample_and_append(self, requests: list[_Request], logits: Tensor,
                           drafts: Sequence[Sequence[int]] | None = None) -> None:
        if self._num_text_ids < logits.shape[-1]:
            logits[:, self._num_text_ids:] = float("-inf")
        if drafts is not None:
            self._verify_and_append(requests, logits, drafts)
            return
        params = [r.params for r in requests]
        sample_logits = logits  # logprobs report the raw model distribution, as vLLM does
        if any(p.has_penalties or p.min_tokens for p in params):
            stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids)) for p in params]
            sample_logits = apply_penalties(logits, params, [r.prompt_token_ids for r in requests],
                                            [r.token_ids for r in requests], stops)
        constrained = [b for b, r in enumerate(requests) if r.constraint is not None]
        if constrained:  # one bitmask copy for the whole batch
            sample_logits = sample_logits.clone() if sample_logits is logits else sample_logits
            bitmasks, forced = [], []
            for b in constrained:
                rows, ends = requests[b].constraint.row_constraints()
                bitmasks += [(b, bits) for _, bits in rows]
                forced += [(b, token) for _, token in ends]
            apply_row_constraints(sample_logits, bitmasks, forced)
        token_ids = self.sampler(sample_logits, params, [r.generator for r in requests])
        if any(p.logprobs is not None for p in params):
            self._record_logprobs(requests, logits, token_ids)
        for r, token_id in zip(requests, token_ids.tolist()):
            r.append(token_id, self.eos_token_ids)

    def _verify_and_append(self, requests: list[_Request], logits: Tensor, drafts: Sequence[Sequence[int]]) -> None:
        """Speculative rows: request i owns 1 + len(drafts[i]) rows; accept drafts (spec/verify.py) and
        append the emitted tokens one by one, so EOS or a stop inside them ends the request where
        decoding without drafts would."""
        offset = 0
        for r, d in zip(requests, drafts):
            n = len(d) + 1
            rows, offset = logits[offset:offset + n], offset + n  # [n, V]
            p = r.params
            sample_rows = rows
            if p.has_penalties or p.min_tokens:  # row j sees the output extended by the drafts before it
                stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids))
                sample_rows = apply_penalties(rows, [p] * n, [r.prompt_token_ids] * n,
                                              [r.token_ids + list(d[:j]) for j in range(n)], [stops] * n)
            if r.constraint is not None:  # row j as the grammar stands after drafts d[:j]
                sample_rows = sample_rows.clone() if sample_rows is rows else sample_rows
                r.constraint.mask_rows(sample_rows, d)
            if p.greedy:
                emitted = greedy_accept(sample_rows.argmax(-1).tolist(), d)
            else:
                q = getattr(d, "probs", None)  # [n - 1, V] when the drafter sampled (DFlash2 probabilistic)
                emitted = rejection_sample(self.sampler.probs(sample_rows, [p] * n), d, q, r.generator)
            for j, token_id in enumerate(emitted):
                if r.finished:
                    break
                if p.logprobs is not None:
                    self._record_logprobs([r], rows[j:j + 1], torch.tensor([token_id], device=rows.device))
                r.append(token_id, self.eos_token_ids)

    def _logprob_entries(self, logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
        """Per row: {chosen token: Logprob, + the top num_top[row] alternatives} (one host transfer)."""
        chosen, rank, top_lp, top_ids = (x.tolist() for x in compute_logprobs(logits, token_ids, max(num_top)))
        tok = self.tokenizer

        def decode(i: int) -> str | None:
            return tok.decode([i], skip_special_tokens=False) if tok is not None else None

        entries = []
        for b, token_id in enumerate(token_ids.tolist()):
            entry = {token_id: Logprob(chosen[b], rank[b], decode(token_id))}
            for k in range(num_top[b]):
                entry.setdefault(top_ids[b][k], Logprob(top_lp[b][k], k + 1, decode(top_ids[b][k])))
            entries.append(entry)
        return entries

    def _record_logprobs(self, requests: list[_Request], logits: Tensor, token_ids: Tensor) -> None:
        asking = [b for b, r in enumerate(requests) if r.params.logprobs is not None]
        rows = torch.tensor(asking, device=logits.device)
        entries = self._logprob_entries(logits[rows], token_ids[rows], [requests[b].params.logprobs for b in asking])
        for b, entry in zip(asking, entries):
            r = requests[b]
            r.logprobs.append(entry)
            r.cumulative_logprob += next(iter(entry.values())).logprob

    def _record_prompt_logprobs(self, request: _Request, first: int, logits: Tensor) -> None:
        """logits [n, V]: row j predicts prompt token first + j (a preempted request's recompute
        writes the same positions again)."""
        if self._num_text_ids < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self._num_text_ids:] = float("-inf")
        n = logits.shape[0]
        targets = torch.tensor(request.prompt_token_ids[first:first + n], device=logits.device)
        request.prompt_logprobs[first:first + n] = self._logprob_entries(logits, targets,
                                                                         [request.params.prompt_logprobs] * n)
