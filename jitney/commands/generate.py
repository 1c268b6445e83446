"""`jitney generate [--model M] "prompt"`: answer one prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="checkpoint directory, .gguf file or known name")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jitney import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=1
    )
    tok = llm.tokenizer
    if args.raw or not tok.chat_template:
        token_ids = tok.encode(args.prompt)
    else:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        token_ids = tok.encode(text, add_special_tokens=False)
    engine = llm.engine
    request = engine.add_request(engine.make_request(token_ids, params))
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[{request.status.finish_reason}, {request.num_output_tokens} tokens]", file=sys.stderr)
    return 0
