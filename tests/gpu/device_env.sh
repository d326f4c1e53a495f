# Source on the device machine, from the repository root:  source tests/gpu/device_env.sh || exit 1
# The device's python3 has torch and jupyter but no megatron-core: install the carried wheel
# (.whl/, see bench/README.md) into /tmp/site; the notebook extras in .whl/extra only where the
# image lacks the module, so nothing of the image's own stack is shadowed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl || return 1
for pair in papermill:papermill ansicolors:colors tenacity:tenacity entrypoints:entrypoints \
            ipywidgets:ipywidgets widgetsnbextension:widgetsnbextension jupyterlab_widgets:jupyterlab_widgets comm:comm; do
  wheel="${pair%%:*}"; module="${pair##*:}"
  if ! python3 -c "import $module" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/extra/${wheel}-*.whl || return 1
    echo "[device_env] installed $wheel"
  fi
done
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -c 'import torch, megatron.core as m; print(f"[device_env] torch {torch.__version__}, megatron-core {m.__version__}, {torch.cuda.device_count()} GPU(s)")'
