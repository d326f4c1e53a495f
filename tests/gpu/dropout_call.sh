#!/usr/bin/env bash
# GPU evidence for issue 41 on one H100: the presets as shipped (dropout 0.1) against HF's own models, the Llama
# rows against the strengthened plain-PyTorch reference, and the 300-step dropout loss curves, compiled vs stock.
# Each phase has its own timeout; JSON lines (device, date, commit on every row) land in OUTDIR, plus logs.tgz.
#   b (~4.5 min): bench/bert_train.py  throughput rows: bert-base, bert-large as shipped vs HF BertForPreTraining
#   t (~4.5 min): bench/t5_bench.py    throughput rows: t5-base, t5-v1_1-base as shipped vs HF T5ForConditionalGeneration
#   l (~5 min):   bench/train_throughput.py --quick: llama3.2-1b and -3b, workbench vs bench/reference_llama.py
#   d (~3 min):   tests/gpu/dropout_loss.py: bert-base and t5-base, 300 steps, stock then compiled layer (+ PNG)
#   z (~1 min):   the dropout-0 rows (bert-base, t5-base), named throughput-dropout0
# Usage (device, repo root, .whl carried), within the 10-minute limit per command:
#   PHASES=bt GIT_COMMIT=<sha> bash tests/gpu/dropout_call.sh $OUT;  PHASES=ld ... $OUT  (a second call)
set -u
out="${1:?usage: dropout_call.sh OUTDIR}"
phases="${PHASES:?set PHASES, e.g. bt or ld (see the header)}"
steps="${STEPS:-8}"; warmup="${WARMUP:-3}"
mkdir -p "$out"
source tests/gpu/device_env.sh || exit 1
t0=$(date +%s)
say() { echo "$1 rc=$2 after $(( $(date +%s) - t0 ))s"; }
if [[ $phases == *b* ]]; then
  timeout 280 python3 bench/bert_train.py --rows throughput --steps "$steps" --warmup "$warmup" --timeout 200 \
    --out "$out/bert_train.jsonl" > "$out/bert.log" 2>&1; say bert $?; tail -4 "$out/bert.log"
fi
if [[ $phases == *t* ]]; then
  timeout 280 python3 bench/t5_bench.py --rows throughput --steps "$steps" --warmup "$warmup" --timeout 200 \
    --out "$out/t5_bench.jsonl" > "$out/t5.log" 2>&1; say t5 $?; tail -4 "$out/t5.log"
fi
if [[ $phases == *z* ]]; then
  timeout 200 python3 bench/bert_train.py --rows throughput-dropout0 --steps "$steps" --warmup "$warmup" --timeout 150 \
    --out "$out/bert_train.jsonl" > "$out/bert0.log" 2>&1; say bert-dropout0 $?; tail -2 "$out/bert0.log"
  timeout 200 python3 bench/t5_bench.py --rows throughput-dropout0 --steps "$steps" --warmup "$warmup" --timeout 150 \
    --out "$out/t5_bench.jsonl" > "$out/t50.log" 2>&1; say t5-dropout0 $?; tail -2 "$out/t50.log"
fi
if [[ $phases == *l* ]]; then
  timeout 320 python3 bench/train_throughput.py --quick --no-stream-cost --models llama3.2-1b,llama3.2-3b \
    --variants reference/,workbench/ --out "$out/train_throughput.jsonl" > "$out/llama.log" 2>&1
  say llama $?; grep -A8 "^device:" "$out/llama.log" | head -10
fi
if [[ $phases == *d* ]]; then
  timeout 260 python3 tests/gpu/dropout_loss.py --out "$out/dropout_loss.jsonl" --png "$out/dropout_loss.png" \
    --families bert-base,t5-base --runs stock,compiled --timeout 120 > "$out/dropout_loss.log" 2>&1
  say dropout_loss $?; tail -6 "$out/dropout_loss.log"
fi
cd "$out" && tar czf "logs-$phases.tgz" *.log && rm -f *.log
