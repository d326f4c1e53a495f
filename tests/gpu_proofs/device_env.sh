# Source on the device machine, from the repository root:  source tests/gpu_proofs/device_env.sh || exit 1
# what an earlier call of this warm lease left on the GPUs is ended first (see the file)
source "$(dirname "${BASH_SOURCE[0]}")/end_leftovers.sh"
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
# Transformer Engine only where asked (WITH_TE=1): TE importable changes kernel choices, so rows without it never see
# it.  .whl/te_site.tar.xz is bench/te_carry.py's pack, unpacked once per warm lease into /tmp/te_site.
if [[ "${WITH_TE:-0}" == 1 ]]; then
  if [[ ! -d /tmp/te_site/transformer_engine ]]; then  # unpacked whole or not at all (a half tree is never reused)
    rm -rf /tmp/te_site.part && mkdir -p /tmp/te_site.part && tar -xJf .whl/te_site.tar.xz -C /tmp/te_site.part \
      && rm -rf /tmp/te_site && mv /tmp/te_site.part /tmp/te_site || return 1
  fi
  export PYTHONPATH="/tmp/te_site:$PYTHONPATH"
fi
# one on-disk compile cache for the call: a benchmark's repeats after the first hit it (set here, once, for every call)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -c 'import torch, megatron.core as m; print(f"[device_env] torch {torch.__version__}, megatron-core {m.__version__}, {torch.cuda.device_count()} GPU(s)")'
if [[ "${WITH_TE:-0}" == 1 ]]; then
  python3 -c 'import transformer_engine.pytorch as te, transformer_engine as t; print(f"[device_env] transformer-engine {t.__version__}")' || return 1
fi
