#!/usr/bin/env bash
# Batched GPU work on 2 GPUs (device kind nvidia-h200-x2) for the backend's proofs.
# Each phase has its own timeout; results land in OUTDIR as JSON lines (device, date,
# git_commit on every row) plus logs.tgz.
#   1 (~30 s):   bench/allreduce_probe.py: link speed; can TP=2 pay on this machine at all?
#   2 (~4 min):  bench/train_throughput.py: reference vs workbench on GPT-2 small / medium (with the
#                event-stream cost)
#   3 (~2 min):  the TP=2 row on GPT-2 large against one GPU
#   4 (~3.5 min): tests/gpu_proofs/backend_proof.py --compile: losses of tp2, pp2 (even and balanced split) vs one GPU
#   7 (~3 min):  the PP rows (pp2-m8 against pp1-m8, 20 timed steps)
#   8 (~4.5 min): one-GPU rows with device and host profiles of GPT-2 small, and dp2 on GPT-2 medium
#   6 (~1 min):  the TP all-reduce: link probe under NCCL settings and torch's symmetric-memory
#                all-reduces (32 NCCL channels measured 1.29x against 1.28x on the TP=2 row: no gain)
#   9 (~3.5 min): recompute: selective / full against none on GPT-2 medium (speed, memory), and
#                backend_proof's recompute losses against one GPU without recompute
#   5 (~3.5 min): tests/gpu_proofs/bridge_quickstart.py: the quickstart notebook, stop and failure on the GPUs present
# Usage (device, repo root, .whl carried), three calls inside the 10-minute limit per command,
# back to back so the machine stays warm:
#   PHASES=34 GIT_COMMIT=<sha> bash tests/gpu_proofs/perf_call.sh $OUT/a;  PHASES=27 ... $OUT/b;  (PHASES=15 ... $OUT/c)
set -u
out="${1:?usage: perf_call.sh OUTDIR}"
phases="${PHASES:?set PHASES, e.g. 12, 34 or 5 (see the header)}"
mkdir -p "$out"
source tests/gpu_proofs/device_env.sh || exit 1
t0=$(date +%s)
bench() {  # bench NAME TIMEOUT VARIANTS [EXTRA ARGS]
  timeout "$2" python3 bench/train_throughput.py --quick --models gpt2-small,gpt2-medium --variants "$3" "${@:4}" \
    --out "$out/train_throughput.jsonl" > "$out/bench_$1.log" 2>&1
  echo "bench $1 rc=$? after $(( $(date +%s) - t0 ))s"; grep -A20 "^device:" "$out/bench_$1.log" | head -20
}
if [[ $phases == *1* ]]; then
  timeout 90 python3 -m torch.distributed.run --nproc-per-node 2 bench/allreduce_probe.py --out "$out/allreduce_probe.jsonl" > "$out/probe.log" 2>&1
  echo "probe rc=$? after $(( $(date +%s) - t0 ))s"; tail -10 "$out/probe.log"
fi
if [[ $phases == *6* ]]; then
  for setting in "" NCCL_MIN_NCHANNELS=32 NCCL_PROTO=Simple NCCL_ALGO=Tree NCCL_BUFFSIZE=16777216; do
    env $setting timeout 60 python3 -m torch.distributed.run --nproc-per-node 2 bench/allreduce_probe.py --symm-mem \
      --out "$out/allreduce_probe.jsonl" >> "$out/probe.log" 2>&1
    echo "probe [$setting] rc=$? after $(( $(date +%s) - t0 ))s"; grep -A12 "^op " "$out/probe.log" | tail -13
  done
fi
[[ $phases == *2* ]] && bench single 300 "reference/,workbench/gpt2-small,workbench/gpt2-medium"
[[ $phases == *3* ]] && bench tp 150 "workbench/gpt2-large,tp2/" --no-stream-cost
[[ $phases == *8* ]] && bench profiled 330 "reference/,workbench/gpt2-small,workbench/gpt2-medium,dp2/gpt2-medium" --no-stream-cost --profile --host-profile
[[ $phases == *7* ]] && bench pp 200 "pp" --no-stream-cost --steps 20  # 6 timed steps scattered 1.44x..1.82x
if [[ $phases == *9* ]]; then
  bench recompute 200 "workbench/gpt2-medium,recompute-selective/gpt2-medium,recompute-full/gpt2-medium" --no-stream-cost
  timeout 200 python3 tests/gpu_proofs/backend_proof.py --compile --only recompute --out "$out/backend_proof.jsonl" --work /tmp/bpr > "$out/backend_proof_recompute.log" 2>&1
  echo "backend_proof recompute rc=$? after $(( $(date +%s) - t0 ))s"; grep '"test": "recompute"' "$out/backend_proof.jsonl" | cut -c1-400
fi
if [[ $phases == *4* ]]; then
  timeout 260 python3 tests/gpu_proofs/backend_proof.py --compile --only tp2,pp2_even,pp2 --out "$out/backend_proof.jsonl" --work /tmp/bp > "$out/backend_proof.log" 2>&1
  echo "backend_proof rc=$? after $(( $(date +%s) - t0 ))s"; tail -6 "$out/backend_proof.log"
fi
if [[ $phases == *5* ]]; then
  timeout 220 python3 tests/gpu_proofs/bridge_quickstart.py --out "$out/bridge_quickstart.jsonl" --work /tmp/wb --steps 100 > "$out/bridge.log" 2>&1
  echo "bridge_quickstart rc=$? after $(( $(date +%s) - t0 ))s"; tail -c 1500 "$out/bridge.log"
fi
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
