#!/usr/bin/env bash
# One batched GPU evidence call on a 2-GPU machine (the device tool's nvidia-h200-x2).
# Usage (on the device, repo root):  GIT_COMMIT=<sha> bash tests/gpu_proofs/run_evidence.sh OUTDIR
# Phase 1 runs single-GPU proofs side by side (GPU0: conversion then generation throughput;
# GPU1: generation parity with CUDA graphs); phase 2 runs the planner's measurements on both GPUs.
set -u
out="${1:?usage: run_evidence.sh OUTDIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=python3
t0=$(date +%s)
(
  CUDA_VISIBLE_DEVICES=0 timeout 100 $py tests/gpu_proofs/conversion_continue_training.py --out "$out/conversion_continue_training.jsonl" > "$out/conversion.log" 2>&1
  echo "conversion rc=$?"
  CUDA_VISIBLE_DEVICES=0 timeout 200 $py bench/generate_throughput.py --models gpt2-small,gpt2-medium --out "$out/generate_throughput.jsonl" > "$out/generate_throughput.log" 2>&1
  echo "generate_throughput rc=$?"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 220 $py tests/gpu_proofs/generation_parity.py --skip-parallel --out "$out/generation_parity.jsonl" > "$out/generation_parity.log" 2>&1
  echo "generation_parity rc=$?"
) &
wait
echo "phase 1 done after $(( $(date +%s) - t0 ))s"
timeout "${PLANNER_TIMEOUT:-300}" $py tests/gpu_proofs/planner_measure.py --out "$out/planner_measurements.jsonl" \
  --only "${PLANNER_CONFIGS:-small-tp1-mbs4-compiled,small-tp1-mbs8,medium-tp1-mbs4-full,medium-tp1-mbs4-selective,small-tp2-mbs4,small-tp2-sp-mbs8,small-pp2-mbs4,small-dp2-distopt-mbs4}" \
  > "$out/planner.log" 2>&1
echo "planner rc=$? after $(( $(date +%s) - t0 ))s"
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
