#!/usr/bin/env bash
# GPU evidence on one H100: the presets as shipped (dropout 0.1) against HF's own models, the Llama
# rows against the strengthened plain-PyTorch reference, and the 300-step dropout loss curves, compiled vs stock.
# Each phase has its own timeout and appends its JSON lines (device, date, commit on every row) to OUTDIR at once;
# logs-<phases>.tgz keeps the logs.  Estimates (compile time dominates; each row is two fresh processes):
#   1 (~2 min):   bert-base as shipped: workbench vs HF BertForPreTraining (bench/bert_train.py --rows throughput)
#   2 (~2.5 min): bert-large, the same
#   3 (~2.5 min): t5-base as shipped vs HF T5ForConditionalGeneration (bench/t5_bench.py --rows throughput)
#   4 (~2.5 min): t5-v1_1-base, the same
#   l (~5-6 min): llama3.2-1b and -3b: workbench vs bench/reference_llama.py (train_throughput.py --quick)
#   d (~3.5 min): tests/gpu_proofs/dropout_loss.py: bert-base and t5-base, 300 steps, stock then compiled layer (+ PNG)
#   z (~4 min):   bert-base and t5-base with dropout 0 on both sides (rows named throughput-dropout0)
# Usage (device, repo root, .whl carried), each call within the 10-minute limit per command:
#   PHASES=123 GIT_COMMIT=<sha> bash tests/gpu_proofs/dropout_call.sh $OUT;  PHASES=4d ...;  PHASES=l ...
set -u
out="${1:?usage: dropout_call.sh OUTDIR}"
phases="${PHASES:?set PHASES, e.g. 123, 4d or l (see the header)}"
steps="${STEPS:-8}"; warmup="${WARMUP:-3}"
mkdir -p "$out"
source tests/gpu_proofs/device_env.sh || exit 1
t0=$(date +%s)
say() { echo "$1 rc=$2 after $(( $(date +%s) - t0 ))s"; }
row() {  # row SCRIPT PRESET ROWS LOG
  timeout 260 python3 "bench/$1" --rows "$3" --presets "$2" --steps "$steps" --warmup "$warmup" --timeout 200 \
    --out "$out/${1%.py}.jsonl" > "$out/$4.log" 2>&1
  say "$2 $3" $?; tail -3 "$out/$4.log"
}
[[ $phases == *1* ]] && row bert_train.py bert-base throughput bert-base
[[ $phases == *2* ]] && row bert_train.py bert-large throughput bert-large
[[ $phases == *3* ]] && row t5_bench.py t5-base throughput t5-base
[[ $phases == *4* ]] && row t5_bench.py t5-v1_1-base throughput t5-v1_1-base
if [[ $phases == *z* ]]; then
  row bert_train.py bert-base throughput-dropout0 bert-base-dropout0
  row t5_bench.py t5-base throughput-dropout0 t5-base-dropout0
fi
if [[ $phases == *l* ]]; then
  timeout 420 python3 bench/train_throughput.py --quick --no-stream-cost --models llama3.2-1b,llama3.2-3b \
    --variants reference/,workbench/ --out "$out/train_throughput.jsonl" > "$out/llama.log" 2>&1
  say llama $?; grep -A8 "^device:" "$out/llama.log" | head -10
fi
if [[ $phases == *d* ]]; then
  timeout 260 python3 tests/gpu_proofs/dropout_loss.py --out "$out/dropout_loss.jsonl" --png "$out/dropout_loss.png" \
    --families bert-base,t5-base --runs stock,compiled --timeout 120 > "$out/dropout_loss.log" 2>&1
  say dropout_loss $?; tail -6 "$out/dropout_loss.log"
fi
cd "$out" && tar czf "logs-$phases.tgz" *.log && rm -f *.log
