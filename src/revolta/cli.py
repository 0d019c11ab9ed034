"""`revolta` command line: generate text and describe checkpoints.

    revolta generate [--model DIR] [--max-tokens N] [--temperature T] [--seed S] [--chat] [--kv-cache-dtype D]
                     "prompt" ...
    revolta info DIR|config.json [--tp N]
    revolta serve [MODEL] [--host H] [--port P] [vLLM-style flags]

With no --model, `generate` uses the embedded default preset (built offline into the cache on first
use). User mistakes (a missing directory, a bad config, an invalid sampling value) print one line on
stderr and exit with status 2; set REVOLTA_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence

from .ple.placement import PLACEMENTS as PLE_PLACEMENTS  # torch-free

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2."""


# ConfigError, CheckpointError, ChatTemplateError and invalid SamplingParams / prompts are all ValueErrors.
USER_ERRORS = (UserError, ValueError, FileNotFoundError, NotADirectoryError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="revolta", description="Run and study Qwen3.8-Flash-Next.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,info,serve,train-default}")

    gen = sub.add_parser("generate", help="generate text from prompts",
                         description="Generate a completion for each prompt (streamed when there is one).")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text ('-' reads stdin)")
    gen.add_argument("--model", metavar="DIR", help="checkpoint directory, or a preset: trained-default, random-default "
                     "(default: the embedded default, the trained one unless REVOLTA_DEFAULT_MODEL=random)")
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, metavar="T",
                     help="0 = greedy (default: the checkpoint's generation_config, else 1.0)")
    gen.add_argument("--top-p", type=float, metavar="P")
    gen.add_argument("--top-k", type=int, metavar="K")
    gen.add_argument("--min-p", type=float, metavar="P")
    gen.add_argument("--seed", type=int, metavar="S", help="sampling seed (default 0)")
    gen.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--no-thinking", action="store_true", help="with --chat: pre-close the <think> block")
    gen.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, fp16 on CUDA), float32, float16, bfloat16")
    gen.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    gen.add_argument("--no-stream", action="store_true", help="print the text only when it is complete")
    gen.add_argument("--speculative-config", type=_json_flag("--speculative-config"), metavar="JSON",
                     help="as serve takes it: '{\"method\": null}' decodes without drafts; default MTP4 when the "
                          "checkpoint has an MTP layer, drafting only while it pays")
    _add_kv_cache_dtype_flag(gen)
    _add_parallel_flags(gen)

    info = sub.add_parser("info", help="summarise a checkpoint's config",
                          description="Config summary, parameter counts by component, KV bytes per token and "
                                      "fixed state bytes per sequence (spec/model.md §10). Reads no weights.")
    info.add_argument("path", metavar="DIR", help="checkpoint directory, a config.json file, or a preset name "
                      "(default, trained-default, random-default)")
    # serve's vLLM spellings too, so one command line's flags carry over
    info.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                      help="tensor-parallel size for per-GPU figures")
    info.add_argument("--dcp", "-dcp", "--decode-context-parallel-size", dest="dcp", type=int, default=1, metavar="N",
                      help="decode-context-parallel size: the ranks sharing a KV head each hold 1/N of its K/V")
    plan = info.add_argument_group("deployment dry run (with --gpu-memory): cache capacity without a GPU")
    plan.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory of one GPU, e.g. 32 for a V100 32 GB")
    plan.add_argument("--max-model-len", type=int, default=None, metavar="L", help="tokens per request (default: "
                      "the config's max_position_embeddings)")
    _add_kv_cache_dtype_flag(plan, default="auto")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    plan.add_argument("--max-num-seqs", type=int, default=None, metavar="N")
    plan.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                      help="tokens per step: sizes the activation estimate (default: the engine's)")
    plan.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                      help="MTP drafts per step (default: the planner's default; 0 turns speculation off)")
    plan.add_argument("--spec-state-replay", action="store_true",
                      help="plan for speculative state replay: no per-draft state slots (spec/engine.md §3.3)")
    plan.add_argument("--weights-gib", type=float, default=None, metavar="GiB",
                      help="measured weights per GPU (default: a quantized checkpoint's packed and 16-bit "
                           "tensors at --tp; else estimated for AWQ experts)")
    plan.add_argument("--speculative-config", type=_json_flag("--speculative-config"), metavar="JSON",
                      help="plan for this speculative_config, as serve takes it (e.g. DFlash2: "
                           "'{\"method\": \"dflash2\", \"model\": DIR}'); replaces the two flags above")
    info.add_argument("--ple-placement", choices=PLE_PLACEMENTS, default=None,
                      help="where the PLE table would live (default: REVOLTA_PLE_PLACEMENT / VLLM_PLE_* if set, else "
                           "host, the release note's reference deployment); off the device it leaves the GPU budget")
    _add_serve_parser(sub)
    from .presets.train_run import add_parser as add_train_parser

    add_train_parser(sub)
    return parser


def _json_flag(name: str):
    def parse(text: str) -> dict:
        import json

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object: {e.msg}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object, e.g. '{{\"image\": 1}}'")
        return value
    return parse


def _add_kv_cache_dtype_flag(parser, default: str | None = None) -> None:
    """One definition for generate, info and serve; the engine checks the value (its error names the choices)."""
    parser.add_argument("--kv-cache-dtype", default=default, metavar="D", help="auto, fp16, bf16, fp8_e4m3, int8")


def add_dflash2_graph_flags(parser: argparse.ArgumentParser) -> None:
    """--[no-]dflash2-graph-rounds and --[no-]dflash2-draft-graph (EngineConfig's fields of those names; None when not
    given: the engine's default, on where CUDA graphs run). Also the benchmarks' flags."""
    parser.add_argument("--dflash2-graph-rounds", action=argparse.BooleanOptionalAction, default=None,
                        help="DFlash2 verify and commit through CUDA graphs (default: on where CUDA graphs run; "
                             "--no-dflash2-graph-rounds: eager rounds)")
    parser.add_argument("--dflash2-draft-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="DFlash2's drafter forward (block and greedy walk) in CUDA graphs (default: on where "
                             "CUDA graphs run and the drafts are greedy)")


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                        help="split the text model across N ranks (one per GPU over NCCL, or CPU processes over "
                             "gloo; docs/parallel.md)")
    parser.add_argument("-dcp", "--decode-context-parallel-size", type=int, metavar="N",
                        help="stripe the full-attention K/V over N ranks that share a KV head (divides tp / "
                             "kv_heads; docs/parallel.md)")


PARALLEL_ARGS = ("tensor_parallel_size", "decode_context_parallel_size")
# `vllm serve` flags with no revolta counterpart, and what to do instead: argparse alone would say only
# "unrecognized arguments", which leaves a user of the release note's launch lines guessing
VLLM_FLAGS_NOT_TAKEN = {
    "--kernel-config": "DFlash2 kernel options go in --speculative-config's \"sm70_dflash2\" object, "
                       "ple_disk_cascade is unsupported (always off) and ple_disk_release_pages is the environment "
                       "variable VLLM_PLE_DISK_RELEASE_PAGES=1 (or REVOLTA_PLE_DISK_RELEASE_PAGES=1); drop the flag",
    "--safetensors-load-strategy": "revolta maps the checkpoint files itself; for the PLE table on disk pass "
                                   "--ple-placement disk (or VLLM_PLE_CPU_OFFLOAD=1 VLLM_PLE_DISK_OFFLOAD=1 "
                                   "VLLM_SM70_QWEN38_HYBRID_PLE=0); drop the flag",
    "--kv-transfer-config": "revolta has no KV connectors; for CPU KV offload pass --kv-offload-gib G (pinned host "
                            "memory for evicted prefix blocks); drop the flag",
    "--chat-template": "revolta renders the checkpoint's own chat template (its tokenizer_config.json); edit the "
                       "checkpoint's template instead and drop the flag",
}


class _NotTaken(argparse.Action):
    """A known vLLM flag revolta refuses: exit 2 with the flag, why, and the fix (VLLM_FLAGS_NOT_TAKEN)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a vLLM flag revolta does not take: {VLLM_FLAGS_NOT_TAKEN[option_string]}")
PRESET_NAMES = ("default", "trained-default", "random-default")  # presets/load.py's names (torch-free here)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible HTTP server",
                           description="Serve MODEL (default: the embedded default preset) over HTTP: "
                                       "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, ...")
    serve.add_argument("model", nargs="?", metavar="MODEL", help="checkpoint directory (default: embedded preset)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the model name clients use (default: "
                       "the directory name, or 'revolta-default' for the embedded preset); further names are "
                       "accepted aliases, as in vLLM (responses report the first)")
    serve.add_argument("--max-model-len", type=int, metavar="L")
    serve.add_argument("--max-num-seqs", type=int, metavar="N")
    serve.add_argument("--max-num-batched-tokens", type=int, metavar="N")
    _add_kv_cache_dtype_flag(serve)
    serve.add_argument("--kv-cache-gib", type=float, metavar="GiB",
                       help="KV cache size (default: on CUDA what gpu_memory_utilization leaves, on CPU 0.5)")
    serve.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                       help="share of the GPU for weights, graphs and KV cache (default 0.9; CUDA only)")
    serve.add_argument("--kv-offload-gib", type=float, metavar="GiB",
                       help="CPU KV tier in pinned host memory for evicted prefix blocks (default 0: off)")
    serve.add_argument("--block-size", type=int, metavar="N",
                       help="KV block size in tokens (default: chosen for the model; the release note advises "
                            "leaving it unset)")
    serve.add_argument("--enforce-eager", action="store_true", default=None, help="capture no CUDA graphs")
    serve.add_argument("--async-scheduling", action="store_true", default=None,
                       help="launch each decode step before the previous step's tokens are read (hides the "
                            "host's work between steps; prefill, speculation and grammars run synchronously)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                       help="start-up warm-up requests that compile every speculative round's row count and a prefill "
                            "before the first request (default: on with the Triton kernels, i.e. on a GPU)")
    serve.add_argument("--trust-remote-code", action="store_true", default=None,
                       help="accepted for vLLM command lines; revolta runs no code from the checkpoint")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--speculative-config", type=_json_flag("--speculative-config"), metavar="JSON")
    serve.add_argument("--limit-mm-per-prompt", type=_json_flag("--limit-mm-per-prompt"), metavar="JSON",
                       help='most media per request, e.g. \'{"image": 16, "video": 1}\' (default image 1, video 0)')
    serve.add_argument("--allowed-local-media-path", metavar="DIR", help="file:// media only under this directory")
    serve.add_argument("--mm-processor-kwargs", type=_json_flag("--mm-processor-kwargs"), metavar="JSON",
                       help='media preprocessing, e.g. \'{"max_pixels": 262144}\' (fewer tokens per image)')
    serve.add_argument("--max-media-memory-gib", type=float, metavar="GiB",
                       help="most decoded image/video bytes held by requests at once; more wait, then get 503 "
                            "(default: a quarter of MemAvailable at startup)")
    serve.add_argument("--media-wait-timeout", type=float, metavar="S", default=30.0,
                       help="seconds a request waits for media memory before a 503 + Retry-After (default 30)")
    serve.add_argument("--api-key", metavar="KEY", help="require this key (Bearer or x-api-key) on every route "
                       "but /health")
    serve.add_argument("--sse-keep-alive-interval", type=float, metavar="S", default=None,
                       help="seconds of stream silence before a ': keep-alive' comment (default 10, 0 = off)")
    serve.add_argument("--max-pending-requests", type=int, metavar="N",
                       help="most requests in the engine at once; more get 503 + Retry-After (default: no limit)")
    serve.add_argument("--structured-outputs-config", type=_json_flag("--structured-outputs-config"), metavar="JSON",
                       help='structured-output defaults, e.g. \'{"disable_any_whitespace": true}\' (compact JSON)')
    serve.add_argument("--tool-call-parser", default="qwen3_coder", choices=["qwen3_coder", "none"])
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool_choice 'auto' is always on with a tool-call parser")
    serve.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"])
    serve.add_argument("--ple-placement", choices=PLE_PLACEMENTS, default=None,
                       help="where the PLE n-gram table lives: device (default), host (pinned host memory, read "
                            "through a mapped view) or disk (the checkpoint files, read by a PLE worker process); "
                            "also REVOLTA_PLE_PLACEMENT or VLLM_PLE_CPU_OFFLOAD / VLLM_PLE_DISK_OFFLOAD. If the disk "
                            "worker dies or stalls, requests fail and revolta serve exits with status 3")
    _add_parallel_flags(serve)
    add_dflash2_graph_flags(serve)
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--device")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--enable-dev-endpoints", action="store_true",
                       help="serve vLLM's development routes: POST /sleep?level=0|1|2, /wake_up, /pause, /resume; "
                            "GET /is_sleeping, /is_paused (off by default: they are 404)")
    serve.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
    for flag in VLLM_FLAGS_NOT_TAKEN:
        serve.add_argument(flag, nargs="?", action=_NotTaken, help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits with status 2 on its own usage errors
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("generate", "serve"):
        # the startup summary is one line worth seeing on stderr
        logging.getLogger("revolta").setLevel(logging.INFO)
    try:
        return {"generate": _generate, "info": _info, "serve": _serve, "train-default": _train}[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:  # user mistakes as one line; bugs keep their traceback
        if os.environ.get("REVOLTA_DEBUG") or not isinstance(e, USER_ERRORS):
            raise
        print(f"revolta: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def _train(args: argparse.Namespace) -> int:
    from .presets.train_run import run

    run(args, log=lambda line: print(line, flush=True))  # progress shows at once, even through a pipe
    return 0


def _one_line(e: BaseException, limit: int = 600) -> str:
    text = " | ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _info(args: argparse.Namespace) -> int:
    from .config import ModelConfig
    from .ple.placement import resolve_ple_placement
    from .summary import format_summary

    if args.tp < 1:
        raise UserError(f"--tp={args.tp} must be >= 1")
    for flag, value, ok, allowed in (("--max-model-len", args.max_model_len, lambda v: v >= 1, ">= 1"),
                                     ("--max-num-batched-tokens", args.max_num_batched_tokens, lambda v: v >= 1,
                                      ">= 1"),
                                     ("--weights-gib", args.weights_gib, lambda v: v > 0, "> 0"),
                                     ("--num-speculative-tokens", args.num_speculative_tokens, lambda v: 0 <= v <= 8,
                                      "in [0, 8] (0 = no speculation; the engine drafts at most 8)")):
        if value is not None and not ok(value):  # 0 would otherwise read as "not given"
            raise UserError(f"{flag}={value} must be {allowed}")
    if args.path in PRESET_NAMES:  # as generate and serve name them (built on first use; no weights are read)
        from .presets.load import resolve_model

        args.path = str(resolve_model(args.path)[0])
    if not os.path.exists(args.path):
        raise UserError(f"{args.path}: no such file or directory; pass a checkpoint directory or its config.json")
    cfg = ModelConfig.from_pretrained(args.path)
    _check_parallel(cfg, args.tp, args.dcp)
    # the dry run's default is the release note's reference deployment: the table in pinned host memory
    ple = resolve_ple_placement(args.ple_placement, default="host")
    if ple.source == "default":
        ple = type(ple)(ple.value, "default: the release note's reference deployment")
    plan = None
    if args.gpu_memory is not None:  # planned first, so a rejected deployment prints only its error
        from .plan import dry_run_report

        options = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                     ("max_num_batched_tokens", args.max_num_batched_tokens),
                                     ("num_speculative_tokens", args.num_speculative_tokens),
                                     ("spec_state_replay", args.spec_state_replay or None)) if v is not None}
        spec = None
        if args.speculative_config is not None:
            if args.num_speculative_tokens is not None or args.spec_state_replay:
                raise UserError("--speculative-config replaces --num-speculative-tokens and --spec-state-replay; "
                                "give one or the other")
            spec, spec_options = _planned_speculation(cfg, args)
            options.update(spec_options)
        weights = None if args.weights_gib is None else int(args.weights_gib * 2**30)
        if weights is None and cfg.quantization is not None and cfg.quantization.packed:
            from .quantized import weights_per_gpu

            by_part = weights_per_gpu(cfg, args.tp)  # the checkpoint's own formats, as a rank holds them
            weights = by_part["total"] + (by_part["ple_table_host"] // args.tp if ple.value == "device" else 0)
        length = cfg.text.max_position_embeddings if args.max_model_len is None else args.max_model_len
        plan = dry_run_report(cfg, args.gpu_memory, args.tp, length,
                              args.kv_cache_dtype, args.gpu_memory_utilization, weights, ple_placement=ple.value,
                              ple_source=ple.source, weights_measured=args.weights_gib is not None, dcp=args.dcp,
                              **options)
        if spec is not None and spec.is_dflash2:
            plan += _dflash2_notes(spec, args.tp, options["drafter_weights_bytes"], estimated=weights is None)
    print(format_summary(cfg, args.path, tp=args.tp, mtp_weights=_mtp_weights(args.path, cfg)))
    if cfg.quantization is not None and cfg.quantization.packed:
        from .quantized import format_quantization

        print(format_quantization(cfg, tuple(sorted({1, 2, 4, args.tp}))))
    if plan is not None:
        print("\n" + plan)
    elif cfg.text.ple_layer_ids:
        print(f"PLE table placement: {ple.value} [{ple.source}] (--gpu-memory plans the GPU budget with it)")
    return 0


def _check_parallel(cfg, tp: int, dcp: int) -> None:
    """The layout is the engine's to refuse (parallel/config.py), with its fix, before anything is planned."""
    from .parallel import ParallelConfig, validate_parallel

    validate_parallel(ParallelConfig(tp, dcp), cfg)


def _mtp_weights(path: str, cfg) -> bool | None:
    """Whether the checkpoint ships its MTP layer's weights; None when there are no weight files to read."""
    from .model import has_mtp_weights
    from .weights import CheckpointError

    if cfg.text.mtp is None or not os.path.isdir(path):
        return None
    try:
        return has_mtp_weights(path, cfg)
    except CheckpointError:  # a config without weights (no safetensors index or file)
        return None


def _dflash2_notes(spec, tp: int, books: int, estimated: bool) -> str:
    from .units import human_bytes

    sharded = spec.sm70_dflash2.sharded_selector_codebook
    where = "in the weights above" if estimated else "not added to the measured --weights-gib"
    lines = [f"  DFlash2 selector codebooks: {human_bytes(books)} per GPU "
             f"({f'sharded over TP {tp}' if sharded else 'replicated'}; {where}; the drafter's other weights are not "
             "estimated, pass --weights-gib with measured weights)",
             "  sm70_dflash2 options (value [source, release note default]):"]
    return "\n".join(lines + [f"    {line}" for line in spec.sm70_dflash2.describe()]) + "\n"


def _planned_speculation(cfg, args: argparse.Namespace):
    """(resolved SpeculativeConfig, CacheConfig fields) of `--speculative-config`, checked as the engine would."""
    from .spec.resolve import resolve_speculative

    spec, warnings = resolve_speculative(args.speculative_config, cfg, has_mtp=cfg.text.mtp is not None,
                                         dtype="float16", kv_cache_dtype=args.kv_cache_dtype,
                                         tensor_parallel_size=args.tp)
    for warning in warnings:
        print(f"revolta: warning: {warning}", file=sys.stderr)
    options = spec.cache_fields(args.kv_cache_dtype, "float16")
    if spec.is_dflash2:
        from .spec.dflash2.sharded_codebook import codebook_bytes_per_gpu

        options["drafter_weights_bytes"] = codebook_bytes_per_gpu(  # the part of the drafter sharding changes
            spec.drafter.vocab_size, spec.drafter.selector_rank, args.tp, bool(spec.sm70_dflash2.sharded_selector_codebook))
    return spec, options


def _sampling_params(args: argparse.Namespace, defaults=None):
    """SamplingParams from the flags, on top of `defaults` (the checkpoint's generation_config)."""
    from .engine.sampling import SamplingParams

    base = {k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k", "min_p")} if defaults else {}
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "seed": args.seed}
    base.update({k: v for k, v in flags.items() if v is not None})
    try:
        return SamplingParams(**base, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as e:  # name the flag, not the field
        message = str(e).replace("SamplingParams.", "--")
        for field in flags.keys() | {"max_tokens"}:
            message = message.replace(f"--{field}=", f"--{field.replace('_', '-')}=")
        raise UserError(message) from None


def _generate(args: argparse.Namespace) -> int:
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.no_thinking and not args.chat:
        raise UserError("--no-thinking needs --chat (it pre-closes the chat template's <think> block)")
    if not all(prompts):  # before the model loads
        raise UserError(f"prompt {prompts.index('') + 1} is empty; give some text (or '-' with text on stdin)")
    if args.model is not None and not os.path.isdir(args.model) and args.model not in PRESET_NAMES:
        raise UserError(f"--model {args.model}: not a directory; pass a checkpoint directory "
                        "(config.json + *.safetensors), a preset name (trained-default, random-default), or leave "
                        "--model out for the embedded default")
    from .llm import LLM

    _sampling_params(args)  # reject bad flags before loading anything
    spec = {} if args.speculative_config is None else {"speculative_config": args.speculative_config}
    engine_args = {name: getattr(args, name) for name in ("kv_cache_dtype", *PARALLEL_ARGS)
                   if getattr(args, name) is not None}
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, **spec, **engine_args)
    try:
        return _print_generated(llm, prompts, args)
    finally:
        llm.close()  # stops the tensor-parallel ranks


def _print_generated(llm, prompts: list[str], args: argparse.Namespace) -> int:
    params = _sampling_params(args, llm.get_default_sampling_params())
    if args.chat:
        prompts = [llm.render_chat([{"role": "user", "content": p}], enable_thinking=not args.no_thinking)
                   for p in prompts]
    if len(prompts) == 1 and not args.no_stream:
        printed = 0
        for out in llm.stream(prompts, params):
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
        return 0
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        if len(prompts) > 1:
            print(f"--- [{i}] {out.outputs[0].finish_reason}, {len(out.outputs[0].token_ids)} tokens")
        print(out.outputs[0].text)
    return 0


def _require_server_extra() -> None:
    """One line naming the fix when the server extra is missing, before anything loads (uvicorn is imported by
    run_server only after the model is up)."""
    try:
        import uvicorn  # noqa: F401

        from .server import app  # noqa: F401  (fastapi, pydantic, starlette)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if missing == "revolta":  # a bug in revolta, not a missing package: keep the traceback
            raise
        raise UserError(f"revolta serve needs the server extra ({missing or e} is not installed): "
                        "pip install 'revolta[server]' (from a checkout: pip install -e '.[server]')") from None


def _reserve_address(host: str, port: int) -> socket.socket:
    """The listening address, bound before the model loads and handed to the server (as vLLM does): a taken port is
    an error now rather than after minutes of loading, and nothing started meanwhile can take it (the tensor-parallel
    ranks' gloo listeners bind ephemeral ports, which a port picked by binding port 0 is one of). Not listening yet:
    a client is refused until the server starts, as before."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, OverflowError) as e:
        raise UserError(f"--host {host} --port {port}: not an address to listen on ({e}); pass e.g. --host 0.0.0.0 "
                        "--port 8000") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port, or stop the "
                        "server using it") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    _require_server_extra()
    if args.model is not None and not os.path.isdir(args.model) and args.model not in PRESET_NAMES:
        raise UserError(f"{args.model}: not a directory; pass a checkpoint directory, a preset name "
                        "(trained-default, random-default), or no MODEL for the embedded default")
    from .server.app import run_server
    from .server.config import DEFAULT_KEEP_ALIVE_S, ServerConfig

    engine_args = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens",
                                                          "kv_cache_dtype", "kv_cache_gib", "enable_prefix_caching",
                                                          "speculative_config", "limit_mm_per_prompt",
                                                          "mm_processor_kwargs", "allowed_local_media_path",
                                                          "ple_placement", "dflash2_graph_rounds",
                                                          "dflash2_draft_graph", "gpu_memory_utilization",
                                                          "kv_offload_gib", "block_size", "enforce_eager",
                                                          "async_scheduling",
                                                          "warmup", "trust_remote_code", *PARALLEL_ARGS)
                   if getattr(args, name) is not None}
    if args.enable_auto_tool_choice and args.tool_call_parser == "none":
        raise UserError("--enable-auto-tool-choice needs a tool-call parser: drop --tool-call-parser none (or drop "
                        "--enable-auto-tool-choice)")
    names = args.served_model_name or [os.path.basename(os.path.normpath(args.model)) if args.model
                                       else "revolta-default"]
    name, aliases = names[0], tuple(names[1:])
    keep_alive = DEFAULT_KEEP_ALIVE_S if args.sse_keep_alive_interval is None else args.sse_keep_alive_interval
    from .engine.structured import compact_json_default

    compact_json = compact_json_default(args.structured_outputs_config, "--structured-outputs-config")
    media_flags = {"max_media_memory_gib": args.max_media_memory_gib, "media_wait_timeout_s": args.media_wait_timeout}
    ServerConfig(served_model_name=name, served_model_aliases=aliases, sse_keep_alive_interval=keep_alive,
                 max_pending_requests=args.max_pending_requests, **media_flags)  # check the flags before loading
    from .multimodal.processor import parse_limits

    parse_limits(args.limit_mm_per_prompt)  # the LLM applies them; a bad one is an error before loading
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise UserError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a directory")
    sock = _reserve_address(args.host, args.port)  # the last check before the model loads
    try:
        from .llm import LLM

        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                  max_model_len=args.max_model_len, **engine_args)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    config = ServerConfig(served_model_name=name, served_model_aliases=aliases, model_path=str(llm.model_path),
                          max_model_len=llm.max_model_len,
                          api_key=args.api_key, sse_keep_alive_interval=keep_alive,
                          tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                          reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
                          max_pending_requests=args.max_pending_requests,
                          structured_disable_any_whitespace=compact_json,
                          enable_dev_endpoints=args.enable_dev_endpoints, **media_flags)
    return run_server(llm, config, args.host, args.port, fault_injection=args.enable_fault_injection, sock=sock)


if __name__ == "__main__":
    sys.exit(main())
