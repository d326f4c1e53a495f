#!/usr/bin/env bash
# The headline rows under the measurement protocol (bench/harness.Protocol: 3 interleaved repeats a side in fresh
# processes), in one device call on two GPUs of one host: GPU 0 runs BERT-base, then T5-base, each as shipped against
# HF's own compiled model; GPU 1 runs Llama-3.2-1B against the plain compiled Llama.  Each side of each ratio runs on
# one GPU, so the two GPUs only save time.  Rows go to OUTDIR/{bert_train,t5_bench,train_throughput}.jsonl, logs
# to OUTDIR/logs.tgz.  Run from the repository root with .whl carried:
#   GIT_COMMIT=<sha> bash bench/headline_call.sh $OUT
# ROWS (default "bert t5 llama") picks rows; each has its own time limit (a killed row leaves its log).
set -u
out="${1:?usage: headline_call.sh OUTDIR}"
rows="${ROWS:-bert t5 llama}"
mkdir -p "$out"
source tests/gpu_proofs/device_env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache  # repeats after the first hit the on-disk compile cache
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
gpu0() {
  if [[ $rows == *bert* ]]; then
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${BERT_S:-300}" python3 bench/bert_train.py --rows throughput --presets bert-base \
      --timeout 200 --out "$out/bert_train.jsonl" > "$out/bert.log" 2>&1; say "bert rc=$?"
  fi
  if [[ $rows == *t5* ]]; then
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${T5_S:-270}" python3 bench/t5_bench.py --rows throughput --presets t5-base \
      --timeout 200 --out "$out/t5_bench.jsonl" > "$out/t5.log" 2>&1; say "t5 rc=$?"
  fi
}
gpu1() {
  if [[ $rows == *llama* ]]; then
    CUDA_VISIBLE_DEVICES=1 timeout -k 5 "${LLAMA_S:-560}" python3 bench/train_throughput.py --models llama3.2-1b \
      --variants reference/,workbench/ --no-stream-cost --variant-timeout 200 --out "$out/train_throughput.jsonl" \
      > "$out/llama.log" 2>&1; say "llama rc=$?"
  fi
}
gpu0 & gpu1 & wait
for f in bert t5 llama; do
  [[ -f $out/$f.log ]] && { echo "== $f"; grep -E "^(row|throughput|variant|reference/|workbench/|device:)|FAILED|Error" "$out/$f.log" | tail -12; }
done
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
say done
