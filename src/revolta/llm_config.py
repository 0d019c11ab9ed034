"""What `LLM(...)` accepts besides the model, how it becomes an EngineConfig, and how it is reported.

    check_engine_args   vLLM `LLM(...)` / `vllm serve` names revolta accepts (unknown names raise TypeError)
    resolve_device / resolve_dtype   "auto" and names -> torch objects
    load_tokenizer      the checkpoint's tokenizer (or the directory named), None when skipped or absent
    read_checkpoint_json   one of the checkpoint's JSON files ({} when it has none), e.g. generation_config.json
    engine_config       the engine arguments -> EngineConfig
    effective_config    (name, value, source) of every setting in force, and the start-up log lines
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .device import resolve_device  # noqa: F401  (LLM picks its device through here)
from .engine import CPU_KV_CACHE_GIB, EngineConfig
from .engine.engine import GRAPH_RESERVE_ENV
from .kernels.quant.common import SPLITK_FIXUP_ENV, fixup_default
from .llm_load import speculation_source
from .ple.load import ple_memory
from .presets.default import PRESET_MARKER
from .presets.load import TRAINED
from .spec.config import DFLASH2_METHODS, SpeculativeConfig
from .spec.dflash2.checks import check_pipeline_parallel
from .tokenizer import Tokenizer

logger = logging.getLogger("revolta.llm")  # the start-up log is the LLM's

# vLLM `LLM(...)` / `vllm serve` names that revolta accepts. Those not in ENGINE_CONFIG_ARGS or MEDIA_ARGS are
# recorded and do not change generation (the startup log says so).
ENGINE_ARG_NAMES = frozenset({
    "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "revision", "tokenizer_revision",
    "download_dir", "load_format", "quantization", "tensor_parallel_size", "decode_context_parallel_size",
    "pipeline_parallel_size",
    "gpu_memory_utilization", "swap_space", "cpu_offload_gb", "max_num_seqs", "max_num_batched_tokens",
    "kv_cache_dtype", "block_size", "enable_prefix_caching", "enforce_eager", "speculative_config",
    "limit_mm_per_prompt", "max_logprobs", "disable_log_stats", "generation_config", "compilation_config",
    "mm_processor_kwargs", "allowed_local_media_path",
    "structured_outputs_config",  # {"disable_any_whitespace": true}: compact JSON for every structured request
    # revolta's own engine knobs (EngineConfig)
    "kv_cache_gib", "kv_offload_gib", "cudagraph_mem_mib", "cudagraph_capture_sizes",
    "max_num_encoder_input_tokens", "encoder_cache_size",
    "ple_placement",  # where the PLE n-gram table lives: "device", "host" or "disk" (ple/placement.py)
    "dflash2_graph_rounds", "dflash2_draft_graph",  # DFlash2 rounds / its drafter in CUDA graphs (EngineConfig)
    "warmup",  # start-up warm-up requests (engine/warmup.py; EngineConfig.warmup)
    "async_scheduling",  # plain decode steps launch before the previous step's tokens are read (engine/async_step.py)
})
LOAD_ARGS = ("ple_placement",)  # arguments that shape how the weights load
# vLLM arguments the media path consumes (multimodal/processor.py)
MEDIA_ARGS = ("limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path")
# arguments the engine consumes (the rest are accepted for compatibility and logged)
ENGINE_CONFIG_ARGS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "enable_prefix_caching",
                      "gpu_memory_utilization", "block_size", "enforce_eager", "kv_cache_gib", "kv_offload_gib",
                      "cudagraph_mem_mib", "cudagraph_capture_sizes", "max_num_encoder_input_tokens",
                      "encoder_cache_size", "speculative_config", "tensor_parallel_size",
                      "decode_context_parallel_size", "dflash2_graph_rounds", "dflash2_draft_graph", "warmup",
                      "async_scheduling")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def load_tokenizer(model_path: Path, tokenizer: str | Path | None, skip: bool) -> Tokenizer | None:
    if skip:
        return None
    path = Path(tokenizer).expanduser() if tokenizer is not None else model_path
    if not (path / "tokenizer.json").is_file():
        if tokenizer is not None:
            raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} has no tokenizer.json")
        logger.warning("%s has no tokenizer.json: only {'prompt_token_ids': [...]} prompts work and outputs "
                       "have no text (pass tokenizer=DIR to fix)", model_path)
        return None
    return Tokenizer.from_pretrained(path)


def read_checkpoint_json(model_path: Path, name: str) -> dict[str, Any]:
    path = model_path / name
    return json.loads(path.read_text()) if path.is_file() else {}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> float32 on CPU, float16 on CUDA (the V100 path has no bf16); else a name or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto', 'float32', 'float16' or 'bfloat16'")
    return _DTYPES[dtype]


def check_engine_args(engine_args: Mapping[str, Any], seed: Any = 0) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer (it seeds requests that have no SamplingParams.seed)")
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
    if engine_args.get("pipeline_parallel_size", 1) != 1:
        raise ValueError(f"pipeline_parallel_size={engine_args['pipeline_parallel_size']}: only 1 is supported "
                         "(tensor_parallel_size splits the model across devices)")


# vLLM's names for a checkpoint's own format (revolta runs the format the checkpoint declares, never another)
QUANTIZATION_ALIASES = {"awq": ("awq", "awq_marlin"), "compressed-tensors": ("compressed-tensors",),
                        "modelopt": ("modelopt", "modelopt_fp4", "nvfp4"), "fp8": ("fp8",)}


def check_quantization(quantization: str | None, cfg: ModelConfig) -> None:
    """vLLM's `quantization=` names the checkpoint's format; revolta quantizes nothing on load, so another name
    (or one for a 16-bit checkpoint) would be silently ignored: refuse it with what the checkpoint holds."""
    if quantization is None:
        return
    method = cfg.quantization.method if cfg.quantization is not None else None
    if quantization in QUANTIZATION_ALIASES.get(method, ()):
        return
    holds = "16-bit weights" if method is None else f"{method!r} weights ({cfg.quantization.describe()})"
    raise ValueError(f"quantization={quantization!r} does not match this checkpoint, which holds {holds}; revolta "
                     "runs the checkpoint's own format and quantizes nothing on load: leave quantization unset")


def engine_config(engine_args: Mapping[str, Any], device: torch.device, max_model_len: int,
                  speculative_config: SpeculativeConfig, cfg: ModelConfig,
                  fit_max_model_len: bool = False) -> EngineConfig:
    """The EngineConfig of `LLM(...)`'s engine arguments (speculative_config already resolved; fit_max_model_len:
    max_model_len is the checkpoint's, lowered to what the cache holds), checked against the checkpoint's config."""
    check_quantization(engine_args.get("quantization"), cfg)
    args = {name: engine_args[name] for name in ENGINE_CONFIG_ARGS if name in engine_args}
    if "cudagraph_capture_sizes" in args:
        args["cudagraph_capture_sizes"] = tuple(args["cudagraph_capture_sizes"])
    args["speculative_config"] = speculative_config
    if device.type == "cpu":
        args.setdefault("max_num_seqs", 16)
    # the torch references are the CPU path; on a GPU the Triton kernels run the cache
    args["kernels"] = "triton" if device.type == "cuda" else "torch"
    return EngineConfig(max_model_len=max_model_len, fit_max_model_len=fit_max_model_len, **args)


def effective_config(llm: Any) -> list[tuple[str, Any, str]]:
    """(name, value, source) of every engine setting in force in `llm` (an LLM); source is "argument", "environment",
    "checkpoint" or "default" (with how a default was resolved)."""
    def arg(name: str) -> str:
        return "argument" if llm._explicit.get(name) or name in llm.engine_args else "default"

    engine = llm.engine
    ec = engine.config
    rows: list[tuple[str, Any, str]] = [
        ("model", llm.model_path, "embedded default" if llm.is_default_model else "argument"),
        ("dtype", str(llm.dtype).removeprefix("torch."), arg("dtype") if llm._explicit["dtype"]
         else f"default (auto on {llm.device.type})"),
        ("device", llm.device, arg("device") if llm._explicit["device"] else "default (cuda if available)"),
        ("seed", llm._seed, arg("seed")),
        ("max_model_len", llm.max_model_len, "argument" if llm._explicit["max_model_len"]
         else f"fitted to the KV cache (the checkpoint's {llm.cfg.text.max_position_embeddings:,} does not fit)"
         if engine.max_model_len_fitted else "checkpoint (max_position_embeddings)"),
    ]
    for name in ("tensor_parallel_size", "decode_context_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_gib", "kv_offload_gib",
                 "block_size", "enforce_eager", "async_scheduling", "dflash2_graph_rounds", "dflash2_draft_graph"):
        if name == "kv_cache_gib" and ec.kv_cache_gib is None:  # the size in force, not "None"
            on_cpu = llm.device.type != "cuda"
            rows.append((name, CPU_KV_CACHE_GIB if on_cpu else None, "default (the CPU allowance)" if on_cpu
                         else "default (what gpu_memory_utilization leaves)"))
            continue
        if name.startswith("dflash2") and getattr(ec, name) is None:  # the value in force
            graphs_run = llm.device.type == "cuda" and ec.use_cuda_graphs
            rows.append((name, graphs_run and ec.dflash2_graphs(name),
                         "default (on where CUDA graphs run)" if graphs_run else "default (no CUDA graphs here)"))
            continue
        rows.append((name, getattr(ec, name), arg(name)))
    rows.append(("block_size (effective)", engine.plan.layout.block_size,
                 arg("block_size") if ec.block_size else "default (chosen for the model)"))
    rows.append(("kernels", ec.kernels, f"default for {llm.device.type}"))
    if llm.cfg.quantization is not None and llm.cfg.quantization.packed:  # packed GEMVs / MoE on the Triton path
        fixup = fixup_default()
        rows.append(("packed split-K reduce", "inside the kernels (FIXUP)" if fixup else "reduce launches",
                     f"environment ({SPLITK_FIXUP_ENV}=1)" if fixup else f"default (opt-in: {SPLITK_FIXUP_ENV}=1)"))
    graphs = engine.graphs or engine.spec_graphs
    if graphs is not None:
        rows.append(("cudagraph_capture_sizes", graphs.batch_sizes, arg("cudagraph_capture_sizes")))
        sg = engine.spec_graphs
        what = "decode steps" if sg is None else \
            f"speculative rounds ({'MTP draft steps, ' if sg.draft_graph else 'eager drafts, '}verify, commit)"
        rows.append(("cuda graphs", f"{what}, {graphs.used_bytes / 2**20:,.0f} MiB", "captured at start-up"))
    else:
        why = "enforce_eager" if ec.enforce_eager else "no CUDA" if llm.device.type != "cuda" else \
            "torch kernels" if ec.kernels != "triton" else \
            "DFlash2 rounds run eager (dflash2_graph_rounds off)" if ec.tensor_parallel_size == 1 else \
            "tensor_parallel_size > 1 runs eager on CUDA (bounded collective waits cannot be captured)"
        rows.append(("cuda graphs", "off", why))
    env = next((v for v in GRAPH_RESERVE_ENV if v in os.environ), None)
    mem_source = "argument" if ec.cudagraph_mem_mib is not None else f"environment ({env})" if env else \
        "default (1200 MiB with DFlash2, else 700 MiB)"
    rows.append(("cudagraph_mem_mib", ec.resolved_cudagraph_mem_mib(), mem_source))
    rows.append(("warmup", llm.warmup.describe() if llm.warmup is not None else "off",
                 arg("warmup") if ec.warmup is not None else
                 "default (on where the Triton kernels run)" if ec.use_warmup
                 else "default (off with the torch kernels)"))
    rows.append(("ple_placement", ple_memory(llm.model).describe(), llm.ple_placement.source))
    spec_source = arg("speculative_config") if "speculative_config" in llm.engine_args else \
        speculation_source(llm.cfg, llm.mtp_weights)
    rows.append(("speculative_config", llm.speculative_config.describe(), spec_source))
    rows.append(("disable_any_whitespace", llm.compact_json, "argument (structured_outputs_config)"
                 if "structured_outputs_config" in llm.engine_args else "default (per request)"))
    if engine.encoder_cache is not None:
        rows.append(("limit_mm_per_prompt", llm.mm_limits, "argument" if "limit_mm_per_prompt" in llm.engine_args
                     else "default (1 image, no video)"))
        rows.append(("max_num_encoder_input_tokens", engine.encoder_budget, arg("max_num_encoder_input_tokens")))
        rows.append(("encoder_cache_size", engine.encoder_cache.capacity, arg("encoder_cache_size")))
    return rows


def model_origin(model_path: Path, is_default: bool) -> str:
    """What was loaded, for the start-up line: a checkpoint, or which embedded preset (its marker file says)."""
    if not is_default:
        return "checkpoint"
    if read_checkpoint_json(model_path, PRESET_MARKER).get("preset") == TRAINED:
        return "embedded default preset (trained on the Python standard library: it writes Python-shaped code)"
    return "embedded default preset (random weights: output is not meaningful text)"


def log_summary(llm: Any, seconds: float) -> None:
    """The start-up log: what was loaded, then the effective configuration table."""
    t, v = llm.cfg.text, llm.cfg.vision
    num_params = sum(p.numel() for p in llm.model.parameters())
    origin = model_origin(llm.model_path, llm.is_default_model)
    parts = [f"{t.num_hidden_layers} layers ({t.num_gdn_layers} GDN + {t.num_qsa_layers} QSA)",
             f"MoE {t.num_experts} experts top-{t.num_experts_per_tok}",
             f"MTP {t.num_mtp_layers}{'' if llm.mtp_weights else ' (no weights in the checkpoint)'}, speculative "
             f"decoding {llm.speculative_config.describe()}" if t.num_mtp_layers else "no MTP",
             "no vision" if v is None else f"vision {v.depth} blocks" if llm.model.model.visual is not None
             else "vision tower not loaded (tensor parallel: text only)"]
    tp = llm.engine.config.tensor_parallel_size  # at tp > 1 llm.model is rank 0's shard
    dcp = llm.engine.config.decode_context_parallel_size
    on = (f"{llm.device} x {tp} ranks (tensor parallel{f', DCP {dcp}' if dcp > 1 else ''})" if tp > 1
          else str(llm.device))
    logger.info("revolta: %s %s | %s on %s | %s | %.1fM params%s | ready in %.1f s", origin, llm.model_path,
                str(llm.dtype).removeprefix("torch."), on, ", ".join(parts), num_params / 1e6,
                " on rank 0" if tp > 1 else "", seconds)
    rows = effective_config(llm)
    width = max(len(name) for name, _, _ in rows)
    logger.info("effective configuration (value [source]):\n%s", "\n".join(
        f"  {name:<{width}} {value!s:<24} [{source}]" for name, value, source in rows))
    unused = sorted(set(llm.engine_args) - {"skip_tokenizer_init", "structured_outputs_config"}
                    - set(ENGINE_CONFIG_ARGS) - set(MEDIA_ARGS) - set(LOAD_ARGS))
    if unused:
        logger.info("engine arguments recorded but not used by this generation path yet: %s", ", ".join(unused))
