"""`jitney serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from jitney.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face directory, a .gguf file or a known name; default: the "
        "bundled SmolLM2) on /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    p.add_argument("model", nargs="?", default=None, help="model directory, .gguf file or known name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="name clients use in 'model' (default: "
                   "the model's file or directory name)")
    p.add_argument("--api-key", default=os.environ.get("JITNEY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $JITNEY_API_KEY, else none)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                   help="largest request body accepted (default 2 MiB)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output token limit (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (default 512)")
    p.add_argument("--policy", default="chunked", help="static | continuous | chunked (default chunked)")
    p.add_argument("--queue", default="fcfs", help="fcfs | priority (default fcfs)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from free memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: by CPU)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine step (shape, ms, start time): a profile for the "
                        "simulator and the serving calibration of `jitney bench profile`")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in [1, 65535], got {args.port}")
    if args.drain_timeout < 0:
        raise CliError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.max_body_bytes < 1024:
        raise CliError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key must not be empty")
    if args.step_log is not None:
        parent = Path(args.step_log).resolve().parent
        if not parent.is_dir():
            raise CliError(f"--step-log: directory {parent} does not exist")


def run(args: argparse.Namespace) -> int:
    _check(args)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=log_format)

    from jitney.config import CacheConfig, SchedulerConfig
    from jitney.model.registry import resolve_model
    from jitney.server.app import ServerOptions
    from jitney.server.launch import build_engine, serve

    # Wrong paths, names and settings fail here, in one line, before the port opens.
    resolve_model(args.model)
    SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    policy=args.policy, queue=args.queue, max_model_len=args.max_model_len or 1)
    CacheConfig(block_size=args.block_size, num_blocks=1 if args.num_blocks is None else args.num_blocks)
    extra = (str(args.model),) if args.model is not None and args.served_model_name is None else ()
    options = ServerOptions(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                            drain_timeout_s=args.drain_timeout, extra_model_names=extra)

    def load():
        return build_engine(
            args.model,
            model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.policy,
            queue=args.queue,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            dtype=args.dtype,
            device=args.device,
            profile_path=args.step_log,
        )

    try:
        serve(load, options, args.host, args.port, log_level=args.log_level)
    except (ValueError, OSError, RuntimeError) as exc:
        raise CliError(f"could not load the model: {exc}") from exc
    return 0
