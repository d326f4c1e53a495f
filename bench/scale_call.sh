#!/usr/bin/env bash
# Llama-3.2-3B on two GPUs under the measurement protocol (bench/harness.Protocol: 3 interleaved repeats a side in
# fresh processes), one device call per CALL value (each under 10 minutes): the layouts issue's rows.
#   CALL=1: the one-GPU default path, DP=2 + distributed optimizer (the advisor's first pick) and the yardstick,
#           torchtitan 0.3.0 (bench/reference_torchtitan.py); micro-batches 4 a rank
#   CALL=2: the one-GPU default path, PP=2 (1F1B) and TP=2 + SP at the same global batch (8 micro-batches), the
#           first repeat of pp2-m8 and tp2-sp profiled (wall vs device time, kernels)
#   CALL=5 / CALL=6: CALL=2 in two calls that fit 10 minutes (CALL=2 ran 2 of its 3 repeats a side in 520 s at
#           c5255f4: one-GPU repeats ~70 s, PP=2 / TP=2 ~50-80 s, a profiled first repeat ~150 s): the one-GPU path
#           beside PP=2 (1F1B, profiled), or beside TP=2 + SP (profiled)
#   CALL=3: the plain FSDP2 loop (bench/reference_fsdp2.py) beside torchtitan and DP=2 + distributed optimizer
#   CALL=4: PP=2 interleaved (VPP=2) and PP=2 without CUDA graphs beside PP=2, same batch as CALL=2
#   CALL=7 / 8 / 9: Llama-3.1-8B (MODEL defaults to llama3.1-8b; one GPU cannot hold it): DP=2 + distributed optimizer,
#           TP=2 + SP, PP=2 (1F1B, 8 micro-batches), each beside torchtitan 0.3.0 on the same two GPUs, global batch 8
#           of 2048 tokens, micro-batch 1 (bench/train_throughput.TWO_GPU_ONLY)
#   CALL=14: Llama-3.1-8B DP=2 + distributed optimizer beside the same with optimizer CPU offload
#           (parallel.optimizer_cpu_offload: 1.0, what two 80 GB cards need): the host step's cost, first losses alike.
#           At 8B a step takes seconds on the host (03d8d5e: 20 timed steps did not end in 200 s); at 3B an offloaded
#           process takes 150-190 s (2ec4a94: 2 repeats a side in 545 s); MODEL=llama3.2-1b fits one call
#   CALL=15 / 16: async TP (parallel.async_tp, #50: TP collectives hidden), Llama-3.2-3B, 8 micro-batches: TP=2 + SP
#           without CUDA graphs beside the same with async TP (its own effect: async TP runs no graphs), or the
#           one-GPU default path beside TP=2 + SP with async TP (the scaling row); CALL=17: Llama-3.1-8B TP=2 + SP with
#           async TP beside torchtitan 0.3.0 (as CALL=8).  A 3B TP process ~50-80 s: ~450 s a call
#   CALL=18: TP=2 + SP beside its no-collective bound (tp2-sp-bound: TP=2 + SP with its all-gathers and
#           reduce-scatters local copies of the same shapes, a diagnostic), 8 micro-batches: the "TP collectives
#           hidden" target (>= 90% of the bound); at 5e098e1 it ran beside tp2-bound (TP=2 without SP, all-reduces
#           skipped), whose norms run on the whole sequence: a lower bar
#   CALL=19 / 20 (.whl/te_site.tar.xz carried: bench/te_carry.py; they set WITH_TE=1): TE's layer at TP=2 + SP with its
#           userbuffers (tp2-te-ub: GEMMs chunked with their all-gather / reduce-scatter, UB_SKIPMC=1) beside SP's
#           bound (tp2-sp-bound; tp2-bound at 5e098e1), or beside TE's layer without userbuffers (tp2-te): what the overlap itself is worth
#   CALL=21: PP=2 interleaved (VPP=2) beside PP=2 1F1B, 8 micro-batches: CALL=4 without its no-graph variant (CALL=4's
#           9 processes do not fit one call at 3B)
#   CALL=22: TP=2 + SP with its GEMMs chunked (parallel.tp_chunked: each collective an exchange with the peer under the
#           other chunk's GEMM) beside TP=2 + SP, 8 micro-batches (SP's bound: CALL=18's, 50.3k at fd12390)
#   CALL=23: CP=2 at 32k through megatron-core's CP in TE's attention (cp2-te-32k) beside the workbench ring (cp2-32k)
#           in one call (WITH_TE=1; Llama-3.2-1B): whether `auto` should take TE's ring where TE is usable
#   CALL=10 / 11: context parallelism (#53), Llama-3.2-1B (MODEL defaults to llama3.2-1b) at 16k / 32k tokens, 32k
#           tokens a step, micro-batch 1: the one-GPU default path at that length (the recompute the planner says it
#           needs: none on an H200 at both) beside CP=2 (ring attention; cuDNN blocks where they run): the scaling row
#           (CALL=11: CP=2's first repeat profiled: where its step goes against one GPU's; PROFILE=0: not profiled)
#   CALL=12 / 13: CP=2 beside torchtitan 0.3.0's CP=2 on the same two GPUs at 16k / 32k (cp2's "vs ref" is torchtitan's
#           CP row; bench/train_throughput.cp_variants).  Each CP call: 6 processes of the protocol (>= 20 timed
#           steps): 60-85 s a process at 2ec4a94, ~450 s a call (CALL=11's profiled repeat: ~570 s; keep LIMIT at 570)
# Rows go to OUTDIR/train_throughput.jsonl (device, date, commit, versions, MFU, memory, kernel path), logs to
# OUTDIR/logs.tgz.  Run from the repository root with .whl (and .whl/titan) carried:
#   CALL=1 GIT_COMMIT=<sha> bash bench/scale_call.sh $OUT
set -u
out="${1:?usage: scale_call.sh OUTDIR}"
call="${CALL:?set CALL=1 to 23}"
case "$call" in 7|8|9|14|17) model="${MODEL:-llama3.1-8b}" ;; 10|11|12|13|23) model="${MODEL:-llama3.2-1b}" ;; *) model="${MODEL:-llama3.2-3b}" ;; esac
mkdir -p "$out"
case "$call" in 19|20|23) export WITH_TE=1 ;; esac  # TE's rows: without TE they would match nothing (or half the call)
source tests/gpu_proofs/device_env.sh || exit 1
t0=$(date +%s)
names() { local v out=""; for v in "$@"; do out+="${out:+,}$v/$model"; done; echo "$out"; }  # full names: no other model
bench() {  # bench LIMIT ARGS...: one protocol measurement, its log kept; no repeat starts that would end past LIMIT
  # (--deadline: the call returns early, its rows so far in train_throughput.partial.jsonl); the limit is the backstop
  timeout -k 20 "$1" python3 bench/train_throughput.py --models "$model" --no-stream-cost --deadline "$(( $1 - 10 ))" \
    --variant-timeout "${VARIANT_TIMEOUT:-200}" --out "$out/train_throughput.jsonl" "${@:2}" > "$out/call$call.log" 2>&1
  echo "call $call rc=$? after $(( $(date +%s) - t0 ))s"; grep -A30 "^device:" "$out/call$call.log" | head -30
  grep -E "FAILED|Error|error:|stopped before" "$out/call$call.log" | head -8
}
case "$call" in
  10) bench "${LIMIT:-570}" --variants "$(names workbench-16k cp2-16k)" ;;
  11) if [ "${PROFILE:-1}" = 0 ]; then bench "${LIMIT:-570}" --variants "$(names workbench-32k cp2-32k)"
      else bench "${LIMIT:-570}" --variants "$(names workbench-32k cp2-32k)" --profile --profile-variants "cp2-32k/$model"; fi ;;
  12) bench "${LIMIT:-570}" --variants "$(names cp2-16k torchtitan-cp2-16k)" ;;
  13) bench "${LIMIT:-570}" --variants "$(names cp2-32k torchtitan-cp2-32k)" ;;
  1) bench "${LIMIT:-570}" --microbatches 4 --variants "$(names workbench dp2-distopt torchtitan)" ;;
  2) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names workbench pp2-m8 tp2-sp)" --profile \
       --profile-variants "pp2-m8/$model,tp2-sp/$model" ;;
  5) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names workbench pp2-m8)" --profile --profile-variants "pp2-m8/$model" ;;
  6) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names workbench tp2-sp)" --profile --profile-variants "tp2-sp/$model" ;;
  3) bench "${LIMIT:-570}" --microbatches 4 --variants "$(names dp2-distopt torchtitan fsdp2)" ;;
  4) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names pp2-m8 pp2-vpp2-m8 pp2-m8-nograph)" ;;
  7) bench "${LIMIT:-570}" --variants "$(names dp2-distopt torchtitan)" ;;
  8) bench "${LIMIT:-570}" --variants "$(names tp2-sp torchtitan)" ;;
  9) bench "${LIMIT:-570}" --variants "$(names pp2-m8 torchtitan)" ;;
  14) bench "${LIMIT:-570}" --variants "$(names dp2-distopt dp2-distopt-offload)" ;;
  15) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names tp2-sp-nograph tp2-sp-async)" ;;
  16) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names workbench tp2-sp-async)" ;;
  17) bench "${LIMIT:-570}" --variants "$(names tp2-sp-async torchtitan)" ;;
  18) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names tp2-sp tp2-sp-bound)" ;;
  19) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names tp2-te-ub tp2-sp-bound)" ;;
  20) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names tp2-te tp2-te-ub)" ;;
  21) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names pp2-m8 pp2-vpp2-m8)" ;;
  22) bench "${LIMIT:-570}" --microbatches 8 --variants "$(names tp2-sp-chunked tp2-sp)" ;;
  23) bench "${LIMIT:-570}" --variants "$(names cp2-32k cp2-te-32k)" ;;
  *) echo "CALL must be 1 to 23" >&2; exit 2 ;;
esac
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
