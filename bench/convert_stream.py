"""Streaming checkpoint conversion at a size that matters: peak memory and disk pace of each step.

    python bench/convert_stream.py --shape llama3.2-1b --workdir /data/convbench [--out bench/results/convert_stream.jsonl]

1. makes a Llama-shaped HF checkpoint of random bf16 weights, written tensor by tensor into 5 GB safetensors shards
   (making it needs no more memory than converting it);
2. copies those files (a plain ``shutil.copyfile`` + fsync): the disk's own pace in this run;
3. converts HF -> TP=2 x PP=2 (``hf_to_megatron``) -> TP=1 (``reshape``) -> HF (``megatron_to_hf``), copying each
   step's input files again right after the step, and compares the result with the original tensor by tensor
   (``compare_hf_dirs``, streaming): it must be bit-identical.

Each copy is made twice: ``shutil.copyfile`` (through the page cache, as ``cp`` does) and ``dd iflag=direct
oflag=direct`` (past it, as the conversions read and write).  The yardstick of a step is the fastest copy of its own
input files in this run (``disk_copy_mb_per_s``, ``pace_vs_copy``), made with the same page-cache state: a virtual disk's pace moves with its host's cache and other
work (copies of one 16 GB checkpoint have run at 0.97 to 1.87 GB/s within one run), so a copy made once, long before
a step, says little about it.  ``pace_vs_fastest_copy`` is the same step against the fastest copy of the run.

Every step runs in a fresh Python process that imports what it needs, then resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), records its RSS (the baseline), runs the step and reads the peak (``VmHWM``, what
``getrusage`` reports as ``ru_maxrss``).  Before the copy and each conversion, the step's input files are dropped
from the page cache (``posix_fadvise(DONTNEED)`` on those files only), so each reads from the disk, as the copy
does.  Each conversion runs as ``workbench convert`` does (``workbench.conversion.prepare_conversion_process``).
One JSON line per step: wall time, peak RSS, peak minus baseline, the largest tensor and the model's size,
bytes read + written and their pace against the copy's, whether the peak is within the target
``largest tensor x 3 + 1.5 GB``, and where the time went: CPU seconds (user, system; all threads), the bytes the
process moved through read()/write() system calls and those it made the disk read and write (``/proc/self/io``
``rchar``/``wchar``, ``read_bytes``/``write_bytes``; memory-mapped reads count only in the latter), and the load
average when the step started (other work on the machine slows every step).
``--shape ci`` is the small model ``tests/conversion/test_convert_streaming.py`` runs.

Disk: each checkpoint is deleted as soon as no later step needs it (the copy once it is timed, the TP=2 x PP=2
checkpoint after ``reshape``, the TP=1 one after ``megatron-to-hf``), so at most four copies of the model are on
disk at once (about 64 GB for ``llama3.1-8b``); the run refuses to start (exit 2) when the work directory's disk has
less than that plus 2 GB free.

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Llama-shaped configs (HF config.json fields); plain RoPE (the workbench refuses rope scaling)
SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "ci": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=2816, vocab_size=16000, tie_word_embeddings=False),
}
FACTOR, SLACK = 3, int(1.5 * 2**30)  # the target: peak RSS <= largest tensor x FACTOR + SLACK
STEPS = ("make-hf", "disk-copy", "hf-to-megatron", "reshape", "megatron-to-hf", "compare")


def hf_config(shape: str) -> dict[str, Any]:
    s = SHAPES[shape]
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "head_dim": s["hidden_size"] // s["num_attention_heads"], "bos_token_id": 128000, "eos_token_id": 128001,
            "torch_dtype": "bfloat16", "initializer_range": 0.02, **s}


def hf_tensors(shape: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint, in file order."""
    c = hf_config(shape)
    h, f, V, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    out["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, h)
    return out


# --------------------------------------------------------------------------- the steps (each in its own process)


def make_hf(shape: str, out: Path) -> dict[str, Any]:
    """Random bf16 weights, written one tensor at a time into 5 GB shards (the writer the conversions use)."""
    import torch

    from workbench.conversion.hf_files import SafetensorsWriter
    from workbench.models.common.conversion_rules import TensorInfo

    out.mkdir(parents=True, exist_ok=True)
    shapes = hf_tensors(shape)
    writer = SafetensorsWriter(out, {k: TensorInfo(s, torch.bfloat16) for k, s in shapes.items()}, 5 * 10**9)
    g = torch.Generator().manual_seed(0)
    for name, s in shapes.items():
        t = torch.randn(s, generator=g, dtype=torch.bfloat16)
        if len(s) == 1:
            t = t.mul_(0.1).add_(1.0)  # norms: ones and noise
        else:
            t = t.mul_(0.02)
        writer.write(name, t)
        del t
    files = writer.close()
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    return {"files": files}


def disk_copy(src: Path, dst: Path) -> dict[str, Any]:
    """Every file under ``src`` copied to the same place under ``dst`` (``shutil.copyfile``, then fsync)."""
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        with open(out, "rb+") as fh:
            os.fsync(fh.fileno())
    return {}


def disk_copy_direct(src: Path, dst: Path) -> dict[str, Any]:
    """The same, past the page cache: ``dd bs=16M iflag=direct oflag=direct conv=fsync`` per file (the disk's own
    pace without the kernel's cache work, which a buffered copy pays on each byte)."""
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dd", f"if={f}", f"of={out}", "bs=16M", "iflag=direct", "oflag=direct", "conv=fsync",
                        "status=none"], check=True)
    return {}


def evict(*paths: Path) -> None:
    """Drop the files under ``paths`` from the page cache (written back first): the next read comes from the disk."""
    for root in paths:
        for f in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _run_step(step: str, a: dict[str, Any]) -> dict[str, Any]:
    if step == "disk-copy":
        return disk_copy(Path(a["src"]), Path(a["out"]))
    if step == "disk-copy-direct":
        return disk_copy_direct(Path(a["src"]), Path(a["out"]))
    from workbench.conversion.api import compare_hf_dirs, hf_to_megatron, megatron_to_hf, reshape

    if step == "make-hf":
        return make_hf(a["shape"], Path(a["out"]))
    if step == "hf-to-megatron":
        hf_to_megatron(a["src"], a["out"], tp=2, pp=2, device="cpu", progress=False, force=True)
    elif step == "reshape":
        reshape(a["src"], a["out"], tp=1, pp=1, force=True)
    elif step == "megatron-to-hf":
        megatron_to_hf(a["src"], a["out"], progress=False, force=True)
    elif step == "compare":
        r = compare_hf_dirs(a["src"], a["out"])
        return {"identical": r["identical"], "tensors": r["tensors"], "differing": r["differing"][:5], "missing": r["missing"][:5]}
    return {}


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _io() -> dict[str, int]:
    try:
        with open("/proc/self/io") as fh:
            return {k: int(v) for k, v in (line.split(": ") for line in fh.read().splitlines())}
    except OSError:
        return {}


def child(step: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one step here and measure it: the peak mark is reset after the imports, so the peak is the step's.  A disk
    copy imports nothing of torch or megatron (it copies files; its pace is timed after the imports either way): eight
    of a run's fourteen processes are copies, and those imports take ~9 CPU seconds a process on a small CPU machine."""
    if not step.startswith("disk-copy"):
        from workbench.conversion import prepare_conversion_process

        prepare_conversion_process()  # as `workbench convert` starts: its environment and allocator settings
        import torch  # noqa: F401  (the imports the steps need, before the baseline)
        import megatron.core.dist_checkpointing  # noqa: F401
        import safetensors.torch  # noqa: F401
        # torch's compiler, which megatron-core no longer imports (workbench/lazy_compile.py) while the steps' own code
        # may (transformers' model modules do): its ~250 MB of modules are imports, not the step's tensors
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

        import workbench.checkpoint  # noqa: F401
        import workbench.backend.model  # noqa: F401
        import workbench.conversion.api  # noqa: F401
        import workbench.conversion.megatron_files  # noqa: F401
        import workbench.conversion.hf_files  # noqa: F401
        import workbench.models.common.one_process  # noqa: F401

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak-RSS mark (VmHWM / ru_maxrss) to the current RSS
        reset = True
    except OSError:
        reset = False
    import resource

    base = _status("VmRSS")
    load = os.getloadavg()
    io0, ru0 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    extra = _run_step(step, args)
    wall = time.perf_counter() - t0
    io1, ru1 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": round(wall, 3), "peak_rss_bytes": _status("VmHWM"), "baseline_rss_bytes": base,
            "peak_reset_after_imports": reset, "cpu_user_s": round(ru1.ru_utime - ru0.ru_utime, 2),
            "cpu_sys_s": round(ru1.ru_stime - ru0.ru_stime, 2),
            "read_syscall_bytes": io1.get("rchar", 0) - io0.get("rchar", 0),
            "write_syscall_bytes": io1.get("wchar", 0) - io0.get("wchar", 0),
            "disk_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "disk_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
            "loadavg": [round(x, 2) for x in load], **extra}


def measure(step: str, args: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``child(step, args)`` in a fresh process (the repository first on its path)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", step, json.dumps(args)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"step {step} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# --------------------------------------------------------------------------- the run


def _bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def run(shape: str, workdir: Path, out: Path | None, keep: bool = False, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """All steps at ``shape`` under ``workdir``; the JSON rows (appended to ``out`` when given)."""
    import torch

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    d = {k: workdir / k for k in ("hf", "copy", "tp2pp2", "tp1", "hf-back")}
    for p in d.values():
        shutil.rmtree(p, ignore_errors=True)
    shapes = hf_tensors(shape)
    numel = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
    model_bytes, largest = 2 * sum(numel.values()), 2 * max(numel.values())
    need, free = 4 * model_bytes + 2 * 10**9, shutil.disk_usage(workdir).free
    if free < need:
        print(f"--workdir {workdir}: {free / 1e9:.1f} GB free, the {shape} run needs {need / 1e9:.1f} GB (four copies "
              "of the model at once) -> free some space or pass a workdir on a larger disk", file=sys.stderr)
        raise SystemExit(2)
    common = {"bench": "convert_stream", "shape": shape, "device": "cpu", "date": datetime.date.today().isoformat(),
              "git_commit": _git_commit(), "cpus": os.cpu_count(), "model_bytes": model_bytes,
              "largest_tensor_bytes": largest, "bound_bytes": largest * FACTOR + SLACK}
    plan = [("make-hf", {"shape": shape, "out": str(d["hf"])}, None, d["hf"]),
            ("disk-copy", {"src": str(d["hf"]), "out": str(d["copy"])}, d["hf"], d["copy"]),
            ("hf-to-megatron", {"src": str(d["hf"]), "out": str(d["tp2pp2"])}, d["hf"], d["tp2pp2"]),
            ("reshape", {"src": str(d["tp2pp2"]), "out": str(d["tp1"])}, d["tp2pp2"], d["tp1"]),
            ("megatron-to-hf", {"src": str(d["tp1"]), "out": str(d["hf-back"])}, d["tp1"], d["hf-back"]),
            ("compare", {"src": str(d["hf"]), "out": str(d["hf-back"])}, None, None)]
    rows: list[dict[str, Any]] = []

    def step_row(step: str, args: dict[str, Any], src: Path | None, dst: Path | None) -> dict[str, Any]:
        if src is not None:
            evict(src)
        r = measure(("disk-copy-direct" if "direct" in step else "disk-copy") if step.startswith("disk-copy") else step, args, env)
        read = _bytes(src) if src else (_bytes(d["hf"]) + _bytes(d["hf-back"]) if step == "compare" else 0)
        written = _bytes(dst) if dst else 0
        row = {**common, "step": step, **r, "peak_minus_baseline_bytes": r["peak_rss_bytes"] - r["baseline_rss_bytes"],
               "bytes_read": read, "bytes_written": written, "mb_per_s": round((read + written) / max(r["wall_s"], 1e-9) / 1e6, 1)}
        row["within_bound"] = row["peak_rss_bytes"] <= common["bound_bytes"]
        row["inputs_evicted"] = src is not None
        if step.startswith("disk-copy"):
            shutil.rmtree(d["copy"], ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    copies: dict[str, list[float]] = {}  # input directory -> the paces of its copies
    for step, args, src, dst in plan:
        row = step_row(step, args, src, dst)
        if step == "disk-copy":
            copies.setdefault(args["src"], []).append(row["mb_per_s"])
            direct = step_row("disk-copy-direct", args, src, dst)
            copies[args["src"]].append(direct["mb_per_s"])
        if step in ("hf-to-megatron", "reshape", "megatron-to-hf"):
            # the same input copied right after the step (evicted again first), through the page cache and past it:
            # whatever the disk, the host's cache or other work did to this step, the copies see too; the fastest copy
            # of the input is the yardstick
            for kind in ("disk-copy", "disk-copy-direct"):
                after = step_row(f"{kind}-after-{step}", {"src": args["src"], "out": str(d["copy"])}, src, d["copy"])
                copies.setdefault(args["src"], []).append(after["mb_per_s"])
            row["disk_copy_mb_per_s"] = max(copies[args["src"]])
            row["pace_vs_copy"] = round(row["mb_per_s"] / row["disk_copy_mb_per_s"], 3)
        if not keep and step in ("reshape", "megatron-to-hf"):  # its input is no longer needed: disk for the next
            shutil.rmtree(src, ignore_errors=True)
    fastest = max(max(v) for v in copies.values())
    for row in rows:
        if "pace_vs_copy" in row:
            row["fastest_copy_mb_per_s"] = fastest
            row["pace_vs_fastest_copy"] = round(row["mb_per_s"] / fastest, 3)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    for row in rows:
        if "pace_vs_copy" in row:
            print(f"{row['step']:>16}: {row['mb_per_s']:7.1f} MB/s = {row['pace_vs_copy']:.3f} of its input's faster copy "
                  f"({row['disk_copy_mb_per_s']:.1f} MB/s), {row['pace_vs_fastest_copy']:.3f} of the run's fastest "
                  f"({fastest:.1f}); peak RSS {row['peak_rss_bytes'] / 1e9:.2f} GB (bound {common['bound_bytes'] / 1e9:.2f})")
    if not keep:
        for p in d.values():
            shutil.rmtree(p, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        res = child(argv[1], json.loads(argv[2]))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    p.add_argument("--workdir", required=True, help="where the checkpoints go (needs about 3x the model's size free)")
    p.add_argument("--out", default=None, help="append the JSON lines here (e.g. bench/results/convert_stream.jsonl)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    a = p.parse_args(argv)
    rows = run(a.shape, Path(a.workdir), Path(a.out) if a.out else None, keep=a.keep)
    ok = all(r.get("identical", True) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
