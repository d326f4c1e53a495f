#!/usr/bin/env bash
# Parallel layouts on 2 GPUs (device kind nvidia-h100-x2), one device call per PHASES value, each well
# inside the 10-minute command limit.  Rows go to OUTDIR/train_throughput.jsonl (device, date, commit);
# logs to OUTDIR/logs.tgz.  Run from the repository root with .whl carried:
#   PHASES=pt GIT_COMMIT=<sha> bash bench/layouts_call.sh $OUT
# Phases:
#   p (~4 min): PP=2 m=8 (1F1B), PP=2 x VPP=2 and PP=2 without graphs, against the one-GPU default path (pp1-m8);
#               GPT-2 medium (MODELS_PP to change), the pp2-m8 row profiled
#   t (~4 min): TP=2, TP=2+SP and the no-collectives bound on GPT-2 large against one GPU, tp2 profiled
#   l (~5 min): Llama-3.2-1B PP rows and Llama-3.2-3B TP rows
#   d (~3 min): DP=2 on GPT-2 medium and Llama-3.2-1B
set -u
out="${1:?usage: layouts_call.sh OUTDIR}"
phases="${PHASES:?set PHASES, e.g. pt}"
mkdir -p "$out"
source tests/gpu_proofs/device_env.sh || exit 1
t0=$(date +%s)
bench() {  # bench NAME TIMEOUT MODELS VARIANTS [EXTRA ARGS]
  # each variant has its own limit (the harness ends its process group); the phase's limit is the backstop, and
  # whatever a killed phase left on the GPUs is ended before the next one (it held 21 GiB once: the next OOMed)
  timeout -k 20 "$2" python3 bench/train_throughput.py --quick --no-stream-cost --models "$3" --variants "$4" "${@:5}" \
    --variant-timeout "${VARIANT_TIMEOUT:-150}" --out "$out/train_throughput.jsonl" > "$out/bench_$1.log" 2>&1
  echo "bench $1 rc=$? after $(( $(date +%s) - t0 ))s"; grep -A30 "^device:" "$out/bench_$1.log" | head -30
  grep -E "FAILED|Error|error:" "$out/bench_$1.log" | head -8
  pkill -9 -f "bench/train_throughput.py" 2>/dev/null; pkill -9 -f "torch.distributed.run" 2>/dev/null; sleep 1
}
[[ $phases == *p* ]] && bench pp 280 "${MODELS_PP:-gpt2-medium}" "pp1-m8/,pp2-m8/,pp2-vpp2-m8/,pp2-m8-nograph/" \
  --profile --profile-variants "pp2-m8/${MODELS_PP:-gpt2-medium}"
[[ $phases == *t* ]] && bench tp 280 gpt2-medium "workbench/gpt2-large,tp2/,tp2-sp/,tp2-bound/" \
  --profile --profile-variants "tp2/gpt2-large,workbench/gpt2-large"
[[ $phases == *l* ]] && bench llama 300 "llama3.2-1b,llama3.2-3b" "pp1-m8/,pp2-m8/,pp2-vpp2-m8/,workbench/llama3.2-3b,tp2/llama3.2-3b,tp2-sp/llama3.2-3b"
[[ $phases == *d* ]] && bench dp 200 "gpt2-medium,llama3.2-1b" "workbench/gpt2-medium,workbench/llama3.2-1b,dp2/"
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
echo "done after $(( $(date +%s) - t0 ))s"
