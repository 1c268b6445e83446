"""`jitney demo`: a handful of chat prompts answered together by continuous batching, streamed."""

from __future__ import annotations

import argparse
import shutil
import sys
import time

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences what a CPU cache is.",
    "What is 12 times 12?",
    "Name three primary colors.",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="answer a few chat prompts together, streamed, with statistics")
    p.add_argument("--model", default=None, help="checkpoint directory, .gguf file or known name")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default="chunked", choices=["static", "continuous", "chunked"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jitney import LLM, SamplingParams
    from jitney.metrics import from_request, summarize

    print(f"loading {args.model or 'the bundled default model'} ...", flush=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, policy=args.policy, max_model_len=2048, max_num_seqs=16)
    print(
        f"loaded {llm.model_name} ({llm.runner.model.dtype}) in {time.perf_counter() - t0:.1f} s; "
        f"{llm.runner.describe_kv_pool(2048)}",
        flush=True,
    )
    engine = llm.engine
    steps: list[tuple[int, int, int]] = []  # (requests, prefill tokens, decode tokens) per step
    engine.step_listeners.append(lambda r: steps.append((r.num_requests, r.prefill_tokens, r.decode_tokens)))

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests = []
    for prompt in DEMO_PROMPTS:
        token_ids = llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False
        )
        requests.append(engine.add_request(engine.make_request(token_ids, params)))

    view = LiveView(DEMO_PROMPTS, sys.stdout.isatty())
    index = {r.request_id: i for i, r in enumerate(requests)}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            view.add(index[out.request_id], out.new_text, out.finished)
        view.render()
    wall = time.perf_counter() - start
    view.finish()

    summary = summarize([from_request(r) for r in requests], duration=wall)
    n_steps = len(steps)
    print("\n--- statistics ---")
    print(f"requests: {len(requests)}, output tokens: {summary.total_output_tokens}, wall: {wall:.2f} s")
    print(
        f"TTFT mean {summary.ttft.mean:.0f} ms, p95 {summary.ttft.p(95):.0f} ms; "
        f"TPOT mean {summary.tpot.mean:.1f} ms"
    )
    print(
        f"throughput: {summary.output_throughput:.1f} output tok/s "
        f"({summary.total_token_throughput:.1f} total)"
    )
    if n_steps:
        print(
            f"steps: {n_steps}; requests per step mean {sum(s[0] for s in steps) / n_steps:.2f}, "
            f"max {max(s[0] for s in steps)}; steps mixing prefill and decode: "
            f"{sum(1 for s in steps if s[1] and s[2])}"
        )
    return 0


class LiveView:
    """On a terminal, one live line per answer redrawn every step; elsewhere, each answer printed
    as soon as it completes (so logs stay readable)."""

    def __init__(self, prompts: tuple[str, ...], tty: bool) -> None:
        self.prompts = prompts
        self.texts = ["" for _ in prompts]
        self.done = [False for _ in prompts]
        self.tty = tty
        self._drawn = 0

    def add(self, i: int, text: str, finished: bool) -> None:
        self.texts[i] += text
        if finished:
            self.done[i] = True
            if not self.tty:
                print(f"\n[{i + 1}] {self.prompts[i]}\n{self.texts[i].strip()}", flush=True)

    def render(self) -> None:
        if not self.tty:
            return
        width = shutil.get_terminal_size().columns - 8
        lines = []
        for i, text in enumerate(self.texts):
            flat = " ".join(text.split())
            mark = "done" if self.done[i] else "...."
            lines.append(f"[{i + 1}] {mark} {flat[-width:] if len(flat) > width else flat}")
        if self._drawn:
            sys.stdout.write(f"\x1b[{self._drawn}F")
        sys.stdout.write("".join(f"\x1b[2K{line}\n" for line in lines))
        sys.stdout.flush()
        self._drawn = len(lines)

    def finish(self) -> None:
        if self.tty:
            for i, text in enumerate(self.texts):
                print(f"\n[{i + 1}] {self.prompts[i]}\n{text.strip()}")
