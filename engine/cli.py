"""`kvgate engine serve`: the OpenAI-compatible model server (flags follow vLLM's names)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kvgate.api.cli_args import (
    SimTiming,
    add_log_level,
    add_otlp_endpoint,
    add_request_template_flag,
    add_simulation_group,
)
from kvgate.api.cli_args import non_negative_float as _non_negative_float
from kvgate.api.cli_args import non_negative_int as _non_negative_int
from kvgate.api.cli_args import port as _port
from kvgate.api.cli_args import positive_float as _positive_float
from kvgate.api.cli_args import positive_int as _positive_int
from kvgate.api.tracing import endpoint_from_env
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.waiting_queue import POLICIES
from kvgate.engine.server.tools.parsers import PARSERS as TOOL_PARSERS
from kvgate.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError

if TYPE_CHECKING:  # the launcher imports uvicorn: only when serving
    from kvgate.engine.server.launcher import ServerOptions

HELP = "serve a model over an OpenAI-compatible HTTP API, with vLLM metrics and KV events"


def _bytes(text: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain byte count."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    number, scale = low, 1
    for suffix, factor in units.items():
        if low.endswith(suffix):
            number, scale = low[: -len(suffix)], factor
            break
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB or 500MiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The flags of `kvgate engine serve`, one function per argument group (in --help order)."""
    _add_model_args(p)
    _add_cache_args(p)
    _add_lora_args(p)
    _add_spec_args(p)
    _add_pd_args(p)
    _add_server_args(p)
    _add_tool_args(p)
    _add_kv_events_args(p)
    _add_simulation_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Which model, on which device, with what context length."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="default",
        help="HF model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct)",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients may send as 'model'; the first is reported in responses and metrics; unset: --model",
    )
    m.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's own")
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weight/activation dtype",
    )
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    m.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    m.add_argument(
        "--cpu-threads",
        type=_positive_int,
        default=None,
        help="torch threads for the model on CPU; unset: torch's default (all cores)",
    )
    m.add_argument(
        "--max-model-len", type=_positive_int, default=None, help="context length; unset: the model's"
    )


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's budgets, the KV pool and the host KV tier."""
    s = p.add_argument_group("scheduling and KV cache")
    s.add_argument(
        "--max-num-seqs", type=_positive_int, default=128, help="most sequences running in one step"
    )
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="token budget per step")
    s.add_argument(
        "--scheduling-policy",
        choices=POLICIES,
        default=EngineConfig.scheduling_policy,
        help="waiting order: fcfs (arrival), priority (the request's priority, lower first, then "
        "arrival; vLLM's), fair (priority, then the tenant served least, then arrival; the tenant "
        "is the x-gateway-inference-fairness-id the EPP stamps)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=_non_negative_int,
        default=EngineConfig.long_prefill_token_threshold,
        help="a prompt with more than this many tokens to compute is long (vLLM's meaning): while "
        "shorter ones arrive, long prompts share --long-prefill-step-tokens a step; 0: no prompt is long",
    )
    s.add_argument(
        "--long-prefill-step-tokens",
        type=_non_negative_int,
        default=EngineConfig.long_prefill_step_tokens,
        help="prompt tokens one step gives the long prompts, all of them together, while short ones "
        "arrive (within 10 s), so a short request waits for a short step; 0: the whole step budget",
    )
    s.add_argument(
        "--max-long-partial-prefills",
        type=_positive_int,
        default=EngineConfig.max_long_partial_prefills,
        help="long prompts being prefilled at once (per tenant with --scheduling-policy fair)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=None,
        help="bound on requests that cannot start at the next step; beyond it 429 + Retry-After; unset: unbounded",
    )
    s.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prefixes",
    )
    s.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        default=None,
        help="bytes for the KV pool, e.g. 2GiB; unset: a budget from free memory",
    )
    s.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory the engine may use"
    )
    s.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        default=None,
        help="exact KV pool size in blocks (overrides the memory budget)",
    )
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.add_argument(
        "--kv-offloading-size",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="GiB of host memory for a second KV tier under the prefix cache: blocks leaving the "
        "device pool are kept there and loaded back on a hit instead of computed again; unset: no tier",
    )
    s.add_argument(
        "--kv-offloading-backend",
        choices=["native"],
        default="native",
        help="how blocks reach the host tier (native: the engine's own copies, as vLLM's)",
    )
    s.add_argument(
        "--kv-offload-on",
        choices=["evict", "compute"],
        default="evict",
        help="when a block is copied to the host tier: when the device pool evicts it (default; the "
        "tiers hold different blocks) or as soon as a step computes it (vLLM's native offloading)",
    )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters served as models."""
    lo = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lo.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve PEFT LoRA adapters as models (and POST /v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    lo.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        type=_lora_module,
        metavar="NAME=PATH",
        help='a PEFT adapter folder served as model NAME (repeatable; also JSON {"name":..,"path":..})',
    )
    lo.add_argument(
        "--max-loras", type=_positive_int, default=1, help="distinct adapters in one step (device slots)"
    )
    lo.add_argument("--max-lora-rank", type=_positive_int, default=16, help="largest adapter rank accepted")
    lo.add_argument(
        "--max-cpu-loras",
        type=_positive_int,
        default=None,
        help="parsed adapters kept in CPU memory, LRU (None: --max-loras)",
    )
    lo.add_argument(
        "--lora-unload-grace",
        type=_non_negative_float,
        default=2.0,
        metavar="SECONDS",
        help="after POST /v1/unload_lora_adapter the adapter leaves /v1/models at once (routers stop "
        "sending) but is still served this long, so requests routed before they noticed succeed; then "
        "new ones get 404 and running ones finish under it. A load of the name meanwhile cancels the "
        "unload (0: refuse at once)",
    )


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (vLLM's flag; the ngram and draft_model methods)."""
    sp = p.add_argument_group("speculative decoding (vLLM's flag)")
    sp.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}\': draft tokens copied from earlier in the sequence, verified in '
        'one step (greedy output unchanged); or \'{"method": "draft_model", "model": PATH_OR_ID, '
        '"num_speculative_tokens": 4}\' (kvgate\'s "draft_num_layers": N: only the first N '
        "layers; no model: the target's own); unset: off",
    )


def _add_pd_args(p: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation: the engine's role and the hand-off's timeouts."""
    pd = p.add_argument_group("prefill/decode disaggregation (vLLM's kv_role)")
    pd.add_argument(
        "--kv-role",
        choices=["none", "producer", "consumer", "both"],
        default="none",
        help="producer: serves kv_transfer_params do_remote_decode by prefilling and holding the prompt's "
        "KV blocks for one pull (GET /v1/kv_transfer/ID); consumer: given x-prefiller-host-port (set by the "
        "EPP) or a producer's kv_transfer_params, pulls those blocks into its prefix cache and decodes, "
        "prefilling locally if the hand-off fails; both: either. Transfers are signed with "
        "$KVGATE_KV_TRANSFER_SECRET (else the --api-key), the same on every engine of the pool; with "
        "neither, a consumer believes only producers on this machine",
    )
    pd.add_argument(
        "--kv-transfer-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a consumer gives a hand-off (the prefill call and the pull) before prefilling locally",
    )
    pd.add_argument(
        "--kv-pin-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a producer holds blocks for a pull that does not come (a consumer that died)",
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server: address, auth, draining, slow clients, logs and traces."""
    h = p.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1", help="address to bind; use 0.0.0.0 in a pod")
    h.add_argument(
        "--port", type=_port, default=8000, help="port to bind (0: any free port, logged at start)"
    )
    h.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1 and tokenizer routes; also read from $KVGATE_API_KEY",
    )
    h.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        help="seconds to drain requests after SIGTERM",
    )
    h.add_argument(
        "--drain-grace-period",
        type=_non_negative_float,
        default=5.0,
        help="seconds after SIGTERM during which the engine reports draining (/health 503, "
        "kvgate:draining 1) but still accepts new requests, so ones routed before the picker "
        "dropped it succeed; then it refuses new ones and drains (like a preStop sleep; 0: refuse at once)",
    )
    add_request_template_flag(
        h, "run chat templates sent in requests (chat_template, chat_template_kwargs.chat_template)"
    )
    h.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=32 * 1024 * 1024,
        help="largest request body, counted as it streams in (chunked too); larger: 413",
    )
    h.add_argument(
        "--header-read-timeout",
        type=_non_negative_float,
        default=10.0,
        help="seconds a client may take to send a request's headers before the connection is closed "
        "(slow-client protection; 0: no limit)",
    )
    h.add_argument(
        "--body-read-timeout",
        type=_non_negative_float,
        default=30.0,
        help="seconds a client may leave a request body unfinished between two chunks before the "
        "request is answered 408 (0: no limit)",
    )
    h.add_argument(
        "--body-total-timeout",
        type=_non_negative_float,
        default=120.0,
        help="seconds a client may take to send a whole request body, however it trickles, before "
        "the request is answered 408 (0: no limit)",
    )
    h.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="require the --api-key on /metrics too (Prometheus sends it as a bearer token: "
        "authorization.credentials_file); off by default, as in vLLM",
    )
    h.add_argument(
        "--enable-failure-injection",
        action="store_true",
        help="honour the x-kvgate-inject-failure header (always on with --simulate)",
    )
    h.add_argument(
        "--http-parser",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="HTTP/1.1 parser (auto: httptools when installed)",
    )
    h.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop (auto: uvloop when installed)",
    )
    add_log_level(h)
    add_otlp_endpoint(h)


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    """Tool calling."""
    t = p.add_argument_group("tool calling (vLLM's flags)")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request has tools): the model decides, and '
        "--tool-call-parser reads its calls out of the text; without it such requests get a 400. "
        '"required" and a named function work without it (decoding constrained to the tools\' schemas)',
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls (for tool_choice auto): hermes (<tool_call>{json}</tool_call>: "
        "Hermes, Qwen2.5/3), llama3_json (Llama 3.1/3.2 JSON), pythonic ([f(x=1)]: Llama 3.2/4)",
    )


def _add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """KV events published for the EPP's prefix-cache index."""
    k = p.add_argument_group("KV events (vLLM ZMQ layout, read by llm-d / kvgate EPP)")
    k.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint to bind, e.g. tcp://*:5557; unset: no KV events",
    )
    k.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint serving missed batches, e.g. tcp://*:5558",
    )
    k.add_argument(
        "--kv-events-topic-endpoint",
        default=None,
        help="host:port put in the topic kv@<host:port>@<model>; unset: this server's address ($POD_IP:port when bound to 0.0.0.0)",
    )
    k.add_argument(
        "--kv-events-connect",
        action="store_true",
        help="connect the PUB socket to --kv-events-endpoint (a subscriber that binds, llm-d style) instead of binding it",
    )
    k.add_argument("--kv-events-buffer", type=_positive_int, default=10_000, help="batches kept for replay")


def _add_simulation_args(p: argparse.ArgumentParser) -> None:
    """The timing model that replaces the model with --simulate."""
    add_simulation_group(
        p,
        "simulation (no model: real scheduler, KV cache, metrics and events)",
        simulate_help="replace the model by a timing model",
        defaults=SimulationConfig().timing(),  # the defaults live there
    )


def _lora_module(text: str) -> tuple[str, str]:
    from kvgate.engine.server.lora import parse_lora_module

    return parse_lora_module(text)


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerOptions]:
    from kvgate.engine.server.launcher import ServerOptions

    config = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_step_tokens=args.long_prefill_step_tokens,
        max_long_partial_prefills=args.max_long_partial_prefills,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offload_on=args.kv_offload_on,
        speculative_config=(
            SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None
        ),
        simulate=args.simulate,
        simulation=SimulationConfig().with_timing(SimTiming.from_args(args)),
    )
    options = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("KVGATE_API_KEY") or None,
        max_queued_requests=args.max_queued_requests,
        shutdown_timeout=args.shutdown_timeout,
        drain_grace_period=args.drain_grace_period,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic_endpoint=args.kv_events_topic_endpoint,
        kv_events_buffer=args.kv_events_buffer,
        kv_events_connect=args.kv_events_connect,
        model_aliases=list(args.served_model_name[1:]) if args.served_model_name else [],
        enable_failure_injection=args.enable_failure_injection,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_request_body_bytes=args.max_request_body_bytes,
        header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout,
        body_total_timeout=args.body_total_timeout,
        metrics_require_api_key=args.metrics_require_api_key,
        http_parser=args.http_parser,
        event_loop=args.event_loop,
        otlp_endpoint=endpoint_from_env(args.otlp_endpoint),
        enable_lora=args.enable_lora,
        lora_modules=list(args.lora_modules),
        lora_unload_grace=args.lora_unload_grace,
        kv_role=args.kv_role,
        kv_transfer_timeout=args.kv_transfer_timeout,
        kv_pin_timeout=args.kv_pin_timeout,
    )
    return config, options


def run(args: argparse.Namespace) -> int:
    from kvgate.api import logs

    logs.configure(args.log_level, args.log_format, args.quiet)
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        print("kvgate engine serve: --kv-events-replay-endpoint needs --kv-events-endpoint", file=sys.stderr)
        return 2
    from kvgate.engine.server.launcher import ServeError, serve

    try:
        config, options = _configs(args)
    except SpeculativeConfigError as exc:
        print(f"kvgate engine serve: {exc}", file=sys.stderr)
        return 2
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model" and config.simulate:
        print(
            "kvgate engine serve: speculative method 'draft_model' needs a model, not --simulate",
            file=sys.stderr,
        )
        return 2
    try:
        return serve(config, options)
    except ServeError as exc:
        print(f"kvgate engine serve: {exc}", file=sys.stderr)
        return 2
