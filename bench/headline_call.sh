#!/usr/bin/env bash
# The headline rows under the measurement protocol (bench/harness.Protocol: 3 interleaved repeats a side in fresh
# processes), in one device call on two GPUs of one host: GPU 0 runs BERT-base, then T5-base, each as shipped against
# HF's own compiled model; GPU 1 runs Llama-3.2-1B against the plain compiled Llama.  Each side of each ratio runs on
# one GPU, so the two GPUs only save time.  Rows go to OUTDIR/{bert_train,t5_bench,train_throughput}.jsonl, logs
# to OUTDIR/logs.tgz.  On a one-GPU machine the rows run in turn on GPU 0 with all of the host's cores.  Run from
# the repository root with .whl carried:
#   GIT_COMMIT=<sha> bash bench/headline_call.sh $OUT
# ROWS (default "bert t5 llama") picks rows; each has its own time limit (a killed row leaves its log).
set -u
out="${1:?usage: headline_call.sh OUTDIR}"
rows="${ROWS:-bert t5 llama}"
mkdir -p "$out"
source tests/gpu_proofs/device_env.sh || exit 1
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
# Each GPU's processes run on their own half of the host's cores with one compile thread: BERT and T5 steps are
# short enough for the host to matter, and a neighbour's compile workers on every core made them noisy (2026-11-28).
export TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=4
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
lgpu=1 half=$(( $(nproc) / 2 ))
(( ngpu == 1 )) && { lgpu=0 half=$(nproc); }
on() { local gpu=$1; shift; CUDA_VISIBLE_DEVICES=$gpu taskset -c "$(( gpu * half ))-$(( gpu * half + half - 1 ))" "$@"; }
row() {  # row NAME GPU LIMIT ARGS...: one benchmark row, its log kept
  local name=$1 gpu=$2 limit=$3; shift 3
  on "$gpu" timeout -k 20 "$limit" python3 "$@" > "$out/$name.log" 2>&1; say "$name rc=$?"
}
# a process's limit: 200 s, 320 s with PROFILE (T5's profiled HF process ran past 200 s at b534cf8)
# REF_COMPILE=reduce-overhead: the HF yardsticks under CUDA graphs (bench/README.md: the BERT yardstick)
family() { echo "bench/$1 --rows throughput --presets $2 --timeout ${PROC_S:-$([[ -n ${PROFILE:-} ]] && echo 320 || echo 200)} --warmup-max ${WARMUP_MAX:-40} ${PROFILE:+--profile} ${REF_COMPILE:+--reference-compile $REF_COMPILE}"; }
if [[ $rows == *bert* && $rows == *t5* && $rows != *llama* ]] && (( ngpu > 1 )); then  # one row a GPU
  row bert 0 "${BERT_S:-540}" $(family bert_train.py bert-base) --out "$out/bert_train.jsonl" &
  row t5 1 "${T5_S:-540}" $(family t5_bench.py t5-base) --out "$out/t5_bench.jsonl" &
  wait
else
  { [[ $rows == *bert* ]] && row bert 0 "${BERT_S:-300}" $(family bert_train.py bert-base) --out "$out/bert_train.jsonl"
    [[ $rows == *t5* ]] && row t5 0 "${T5_S:-270}" $(family t5_bench.py t5-base) --out "$out/t5_bench.jsonl"; } &
  (( ngpu == 1 )) && wait  # one GPU: the Llama row after the others
  [[ $rows == *llama* ]] && row llama $lgpu "${LLAMA_S:-560}" bench/train_throughput.py --models llama3.2-1b --variants reference/,workbench/ \
    --no-stream-cost --variant-timeout 200 ${PROFILE:+--profile --profile-model llama3.2-1b} --out "$out/train_throughput.jsonl" &
  wait
fi
for f in bert t5 llama; do
  [[ -f $out/$f.log ]] && { echo "== $f"; grep -E "^(row|throughput|variant|reference/|workbench/|device:)|FAILED|Error" "$out/$f.log" | tail -12; }
done
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
say done
