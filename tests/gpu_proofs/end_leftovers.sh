# Sourced by tests/gpu_proofs/device_env.sh (tested by tests/bench/test_device_env.py).
# A GPU process an earlier call of this warm lease left behind (a call killed at its limit: its torchrun ranks
# outlived it, one held 74 GiB of a GPU through the next call's measurements) is ended before anything else: only a
# process of this project (its command line runs torchrun, workbench, bench/ or tests/gpu_proofs/) that started
# before this call's session did (so never a process of this call); other GPU processes are only named.  Waits until
# the ended ones are gone (30 s at most).  Silent without nvidia-smi.
if command -v nvidia-smi >/dev/null 2>&1; then
  _wb_start() { awk '{sub(/.*\) /, ""); print $20}' "/proc/$1/stat" 2>/dev/null; }  # start time, clock ticks
  _wb_sid=$(awk '{sub(/.*\) /, ""); print $4}' /proc/$$/stat 2>/dev/null)
  _wb_since=$(_wb_start "${_wb_sid:-$$}"); _wb_since=${_wb_since:-$(_wb_start $$)}
  _wb_end="" _wb_named=""
  while IFS=, read -r _wb_pid _wb_mib; do
    _wb_pid="${_wb_pid//[[:space:]]/}"; _wb_mib="${_wb_mib//[[:space:]]/}"
    [[ "$_wb_pid" =~ ^[0-9]+$ && -d /proc/$_wb_pid && "$_wb_pid" != $$ ]] || continue
    _wb_cmd=$(tr '\0' ' ' < /proc/$_wb_pid/cmdline 2>/dev/null | cut -c1-100)
    _wb_t=$(_wb_start "$_wb_pid")
    if [[ "$_wb_cmd" =~ torch\.distributed\.run|torchrun|workbench|bench/|tests/gpu_proofs/ && -n "$_wb_t" \
          && -n "$_wb_since" && "$_wb_t" -lt "$_wb_since" ]]; then
      _wb_end+="$_wb_pid "
      echo "[device_env] ending pid $_wb_pid (${_wb_mib} MiB), left on the GPUs by an earlier call: $_wb_cmd"
    else
      _wb_named+="${_wb_named:+, }pid $_wb_pid (${_wb_mib} MiB: $_wb_cmd)"
    fi
  done < <(timeout 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
  [[ -z "$_wb_named" ]] || echo "[device_env] WARNING: other processes hold the GPUs (left alone): $_wb_named"
  if [[ -n "$_wb_end" ]]; then
    kill -9 $_wb_end 2>/dev/null
    for _wb_i in $(seq 30); do  # the driver frees a killed context's memory when the process is gone
      _wb_left=""  # gone, or a zombie (its resources, the GPU's memory with them, are freed)
      for _wb_pid in $_wb_end; do
        [[ "$(awk '{sub(/.*\) /, ""); print $1}' /proc/$_wb_pid/stat 2>/dev/null)" =~ ^[^Z]$ ]] && _wb_left+="$_wb_pid "
      done
      [[ -z "$_wb_left" ]] && break; sleep 1
    done
    [[ -z "$_wb_left" ]] || echo "[device_env] WARNING: still alive after 30 s: $_wb_left"
  fi
  unset -f _wb_start; unset _wb_sid _wb_since _wb_end _wb_named _wb_pid _wb_mib _wb_cmd _wb_t _wb_i _wb_left
fi
