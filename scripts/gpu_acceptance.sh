#!/usr/bin/env bash
# One-command GPU acceptance run of te-fl-attention (written for one H200; any CUDA GPU works).
#
#   bash scripts/gpu_acceptance.sh [--out DIR] [--wheels DIR] [--python PY] [--only STEP,...]
#   bash scripts/gpu_acceptance.sh --dry-run      # list the steps and their time budgets
#
# Needs only this repository and a Python with a CUDA build of torch (and triton). It first
# installs what it lacks, pinned (cudnn-frontend 1.32.0, orjson, platformdirs; from --wheels DIR
# when the machine has no network), into a private directory, then runs each step under its own
# timeout and prints its time. Steps that need software the machine lacks (TransformerEngine,
# flash-attn) report "skipped" with the reason instead of failing. Output: one line per step,
#   gpu_acceptance step=NAME rc=RC seconds=S budget=B summary="..."
# a final line
#   gpu_acceptance steps=N passed=P skipped=K failed=F seconds=T
# and one JSON file, DIR/gpu_acceptance.json (every step's summary, exit status, time and the
# tail of its log), plus DIR/te_graphs.log and DIR/te_cudnn_frontend.log (the cuDNN graphs TE
# itself built for its support query and its runs) when TE ran. Exit status: 0 when no step failed, 1 otherwise, 2 without a GPU.
# The budgets add up to at most 8 minutes.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-acceptance-out}"
PY="${PYTHON:-python3}"
WHEELS=""
DRY=0
ONLY=""

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_acceptance: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# name | budget (s) | what it checks | its summary line (regexes, space-separated) | command
STEPS=(
"install|45|pinned dependencies this checkout needs, into a private site dir|^install|install_deps"
"explain_local|20|te-fl-attn explain --device local decides with cuDNN graphs on this GPU|^chosen:|\$PY -m te_fl_attention.cli explain --device local --preset llama3-8b"
"pytest_gpu|70|pytest -m gpu (real-handle cuDNN, Triton and the stages on the GPU)|passed failed error no.tests.ran|\$PY -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests"
"cudnn_agreement|60|real-handle vs deviceless-descriptor cuDNN verdicts, >= 40 configs|^cudnn_agreement|\$PY scripts/gpu/cudnn_agreement.py --out \$STEPDIR"
"te_decisions|45|our decision vs TE's own get_attention_backend (plugin off), same configs|^te_decisions|\$PY scripts/gpu/te_decisions.py --te-graph-log \$WORK/te_graphs.log --out \$STEPDIR"
"graph_diff|25|our cuDNN graphs vs the graphs TE built for the same configs (its log)|^graph_diff|\$PY scripts/gpu/graph_diff.py --log \$WORK/te_graphs.log --out \$STEPDIR"
"te_dpa|45|TE DotProductAttention fwd+bwd with the plugin vs without, >= 10 configs|^te_dpa.configs ^te_dpa:|\$PY scripts/gpu/te_dpa.py --out \$STEPDIR"
"bench_kernels|85|Triton vs torch SDPA, bf16, S=1k/4k/8k, D=64/128, causal or not|^triton_vs_sdpa ^bench_kernels|\$PY benchmarks/bench_kernels.py --out \$STEPDIR"
"bench_measured|60|measured-mode regret over 30 configs|^measured_regret|\$PY benchmarks/bench_measured.py --budget-s 50 --out \$STEPDIR"
"flash_tiny|25|a flash-attn tiny run for every installed flash-attn flavour|^flash_tiny|\$PY scripts/gpu/flash_tiny.py --out \$STEPDIR"
)

field() { local IFS='|'; read -r -a parts <<< "$1"; echo "${parts[$2]}"; }

if [ "$DRY" = 1 ]; then
    total=0
    for s in "${STEPS[@]}"; do
        printf 'step %-16s budget=%3ss  %s\n' "$(field "$s" 0)" "$(field "$s" 1)" "$(field "$s" 2)"
        printf '     %s\n' "$(field "$s" 4)"
        total=$((total + $(field "$s" 1)))
    done
    echo "gpu_acceptance dry_run steps=${#STEPS[@]} budget_s=$total (limit 480)"
    [ "$total" -le 480 ] || { echo "gpu_acceptance: budgets exceed 8 minutes" >&2; exit 1; }
    exit 0
fi

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_acceptance: no CUDA GPU visible to $PY (torch.cuda.is_available() is False);" \
         "nothing run (use --dry-run to list the steps)" >&2
    exit 2
fi

mkdir -p "$OUT"
WORK="$(mktemp -d -t te-fl-acceptance-XXXXXX)"
SITE="$WORK/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TE_FL_ATTN_CACHE="$WORK/probes.sqlite"   # a fresh probe cache: every verdict is probed
export TE_FL_ATTN_DESCRIPTORS="$WORK/descriptors"
unset NVTE_PLUGIN TE_FL_ATTN_DEVICE TE_FL_ATTN_FORCE TE_FL_ATTN_PREFER TRITON_INTERPRET
cd "$ROOT" || exit 2

install_deps() {
    local need=()
    "$PY" -c 'import cudnn; assert cudnn.__version__.startswith("1.32")' 2>/dev/null ||
        need+=("nvidia-cudnn-frontend==1.32.0")
    "$PY" -c 'import orjson' 2>/dev/null || need+=("orjson>=3.8")
    "$PY" -c 'import platformdirs' 2>/dev/null || need+=("platformdirs>=3")
    "$PY" -c 'import rich, packaging' 2>/dev/null || need+=("rich>=13" "packaging>=23")
    if [ ${#need[@]} -gt 0 ]; then
        local src=()
        [ -n "$WHEELS" ] && src=(--no-index --find-links "$WHEELS")
        echo "installing into $SITE: ${need[*]}"
        "$PY" -m pip install -q --no-deps --no-compile --target "$SITE" "${src[@]}" "${need[@]}" ||
            return 1
    fi
    "$PY" - <<'PYEOF'
import importlib.metadata as m
import torch
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "none"
names = ("torch", "triton", "nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12",
         "transformer-engine", "flash-attn", "flash-attn-3", "flash-attn-4")
gpu = torch.cuda.get_device_name().replace(" ", "_")
print("install " + " ".join(f"{n}={v(n)}" for n in names) + f" cuda={torch.version.cuda} gpu={gpu}")
PYEOF
}
export -f install_deps
export PY WHEELS SITE

started=$(date +%s)
passed=0; failed=0; skipped=0; n=0
: > "$WORK/steps.jsonl"
for s in "${STEPS[@]}"; do
    name="$(field "$s" 0)"; budget="$(field "$s" 1)"; pattern="$(field "$s" 3)"
    cmd="$(field "$s" 4)"
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
    n=$((n + 1))
    STEPDIR="$WORK/$name"; mkdir -p "$STEPDIR"
    log="$STEPDIR/log.txt"
    echo "== step $name (budget ${budget}s): $(field "$s" 2)"
    t0=$(date +%s)
    [ "$cmd" = "install_deps" ] && cmd="bash -c install_deps"
    eval "timeout --kill-after=10 $budget $cmd" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    secs=$(( $(date +%s) - t0 ))
    summary="$(grep -E "${pattern// /|}|skipped" "$log" | tail -n 1 | tr -d '"')"
    case $rc in
        0) passed=$((passed + 1)) ;;
        2|5) skipped=$((skipped + 1)) ;;  # 2: the step says what it lacks; 5: pytest ran no test
        *) failed=$((failed + 1)) ;;
    esac
    [ "$rc" -eq 124 ] && summary="timed out after ${budget}s; $summary"
    echo "gpu_acceptance step=$name rc=$rc seconds=$secs budget=$budget summary=\"$summary\""
    STEP_NAME="$name" STEP_RC="$rc" STEP_SECS="$secs" STEP_BUDGET="$budget" STEP_SUMMARY="$summary" \
    STEP_LOG="$log" STEP_DIR="$STEPDIR" "$PY" - >> "$WORK/steps.jsonl" <<'EOF'
import glob, json, os
e = os.environ
log = open(e["STEP_LOG"], errors="replace").read()
data = {}
for path in sorted(glob.glob(os.path.join(e["STEP_DIR"], "*.json"))):
    try:
        data[os.path.basename(path)] = json.load(open(path))
    except ValueError:
        pass
print(json.dumps({"step": e["STEP_NAME"], "rc": int(e["STEP_RC"]), "seconds": int(e["STEP_SECS"]),
                  "budget": int(e["STEP_BUDGET"]), "summary": e["STEP_SUMMARY"],
                  "log_tail": log[-6000:], "results": data}))
EOF
done
total=$(( $(date +%s) - started ))
# TE's own cuDNN graphs (logged by the te_dpa step), for comparing with the graphs we build
for log in "$WORK/te_graphs.log" "$WORK/te_dpa/te_cudnn_frontend.log"; do
    [ -f "$log" ] && cp "$log" "$OUT/"
done
"$PY" - "$WORK/steps.jsonl" "$OUT/gpu_acceptance.json" "$total" <<'EOF'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
json.dump({"seconds": int(sys.argv[3]), "steps": steps}, open(sys.argv[2], "w"), indent=1)
EOF
echo "gpu_acceptance steps=$n passed=$passed skipped=$skipped failed=$failed seconds=$total"
echo "gpu_acceptance: wrote $OUT/gpu_acceptance.json"
[ "$failed" -eq 0 ]
