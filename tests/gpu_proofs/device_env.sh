# Source on the device machine, from the repository root:  source tests/gpu_proofs/device_env.sh || exit 1
# A GPU process an earlier call of this warm lease left behind (a call killed at its limit: its torchrun ranks
# outlived it, one held 74 GiB of a GPU through the next call's measurements) is ended before anything else.
# Only processes of this machine (/proc) that are neither this shell nor one of its ancestors; silent without nvidia-smi.
if command -v nvidia-smi >/dev/null 2>&1; then
  _wb_gpu_pids=""
  _wb_gpu_list=""
  _wb_keep=" $$ "
  _wb_p=$$
  while [[ -r /proc/$_wb_p/status ]]; do  # this shell's ancestors: never ended here
    _wb_p=$(awk '/^PPid:/ {print $2}' /proc/$_wb_p/status 2>/dev/null)
    [[ -z "$_wb_p" || "$_wb_p" == 0 ]] && break
    _wb_keep+="$_wb_p "
  done
  while IFS=, read -r _wb_pid _wb_mib; do
    _wb_pid="${_wb_pid//[[:space:]]/}"; _wb_mib="${_wb_mib//[[:space:]]/}"
    [[ "$_wb_pid" =~ ^[0-9]+$ && -d /proc/$_wb_pid && "$_wb_keep" != *" $_wb_pid "* ]] || continue
    _wb_gpu_pids+="$_wb_pid "
    _wb_gpu_list+="${_wb_gpu_list:+, }pid $_wb_pid (${_wb_mib} MiB: $(tr '\0' ' ' < /proc/$_wb_pid/cmdline 2>/dev/null | cut -c1-80))"
  done < <(timeout 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
  if [[ -n "$_wb_gpu_pids" ]]; then
    echo "[device_env] ending $(echo $_wb_gpu_pids | wc -w) process(es) an earlier call left on the GPUs: $_wb_gpu_list"
    kill -9 $_wb_gpu_pids 2>/dev/null
    sleep 2
  fi
  unset _wb_gpu_pids _wb_gpu_list _wb_keep _wb_p _wb_pid _wb_mib
fi
# The device's python3 has torch and jupyter but no megatron-core: install the carried wheel
# (.whl/, see bench/README.md) into /tmp/site; the notebook extras in .whl/extra only where the
# image lacks the distribution, so nothing of the image's own stack is shadowed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl || return 1
# every wheel in .whl/extra and .whl/titan whose distribution the image lacks (papermill, ipykernel and their
# dependencies: the notebook path; torchtitan and the four it imports: bench/reference_torchtitan.py), checked by
# distribution name in one interpreter
missing=$(python3 - <<'PY'
import glob, importlib.metadata as md, os, re
for wheel in sorted(glob.glob(".whl/extra/*.whl") + glob.glob(".whl/titan/*.whl")):
    dist = re.sub(r"[-_.]+", "-", os.path.basename(wheel).split("-")[0]).lower()
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        print(wheel)
PY
)
if [[ -n "$missing" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $missing || return 1
  echo "[device_env] installed $(echo $missing | wc -w) carried wheels the image lacks (.whl/extra, .whl/titan)"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one on-disk compile cache for the call: a benchmark's repeats after the first hit it (set here, once, for every call)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -c 'import torch, megatron.core as m; print(f"[device_env] torch {torch.__version__}, megatron-core {m.__version__}, {torch.cuda.device_count()} GPU(s)")'
