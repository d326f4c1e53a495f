"""``workbench advise`` and ``workbench calibrate``.

``workbench advise CONFIG --gpus N [--gpu H100-80GB] [--nodes K] [--json] [--top 20] [--profile FILE] [--fp8 | --no-fp8]``
prints every valid layout's predicted speed, sorted, with the planner's fits / OOM (FP8 layouts: opt-in, see
:func:`workbench.advisor.advise.advise`); exit 2 with the
field and the fix on bad input (the config is validated first), 1 when no layout fits, else 0.

``workbench calibrate CONFIG [--out FILE] [--nproc N] [--iters N] [--timeout S] [--cpu]`` measures a calibration
profile on the GPUs it sees (:mod:`workbench.advisor.measure` under the workbench's one-node torchrun, its stores on
the loopback only, supervised like every launch) and writes it as JSON (default ``calibration-<gpu>.json``), to be
passed to ``advise --profile``.  What it does not measure (host time per layer, links between nodes, the fitted constants) it takes from the shipped
profile of the same GPU, and says so in each number's source.  ``--iters`` / ``--timeout`` / ``--nproc`` below 1
(or a timeout that is no finite number) exit 2 before anything starts; ranks that overrun ``--timeout`` are
stopped with their whole process tree, and it exits 1 saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, load_config
from workbench.launch import local_torchrun, run_supervised
from workbench.planner import gpu_spec

__all__ = ["add_cli", "profile_from_raw"]


def _cmd_advise(args: argparse.Namespace) -> int:
    from workbench.advisor.advise import advise, format_advice
    from workbench.advisor.profile import ProfileError, load_profile

    try:
        cfg = load_config(args.file)
        profile = load_profile(args.profile) if args.profile else None
        adv = advise(cfg, args.gpus, gpu=args.gpu, nodes=args.nodes, top=args.top, profile=profile, fp8=args.fp8)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except ProfileError as e:
        print(f"invalid profile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(adv.to_dict(), indent=1) if args.json else format_advice(adv, args.top))
    if adv.best is None:
        print(f"workbench advise: no layout fits {adv.gpu} (exit 1)", file=sys.stderr)
        return 1
    return 0


def _point(x: float, value: float, source: str, estimate: bool = False) -> dict[str, Any]:
    return {"x": float(x), "value": float(value), "source": source, "estimate": estimate}


def profile_from_raw(raw: dict[str, Any], base: Any, gpu: str) -> Any:
    """A :class:`~workbench.advisor.profile.Profile` from :mod:`workbench.advisor.measure`'s numbers; what was not
    measured comes from ``base`` (the shipped profile), its source saying so."""
    from workbench.advisor.profile import profile_from_dict

    here = f"workbench calibrate on {raw['device']} ({raw['date'][:10]}, {str(raw['git_commit'])[:10]})"
    d = base.to_dict()
    kept = f"from the shipped {base.gpu} profile (not measured by this calibration)"

    def inherit(p: dict[str, Any]) -> dict[str, Any]:
        return dict(p, source=f"{kept}: {p['source']}")

    d.update(device=raw["device"], gpu=gpu, date=raw["date"], git_commit=str(raw["git_commit"]),
             notes=[f"measured by {here} on {raw['world_size']} process(es)"])
    d["gemm_tflops"] = [_point(g["gflop_per_call"], g["tflops"], f"{here}: bf16 GEMMs of the layer at TP={g['tp']}")
                        for g in sorted(raw["gemm"], key=lambda g: g["gflop_per_call"])]
    d["attention_tflops"] = [_point(a["seq"], a["tflops"], f"{here}: SDPA forward + backward, causal") for a in raw["attention"]]
    d["memory_gbs"] = _point(0, raw["memory_gbs"], f"{here}: a 1 GiB copy")
    d["optimizer_ns_per_param"] = _point(0, raw["optimizer_ns_per_param"], f"{here}: fused AdamW step")
    d["fp8_gemm_speedup"] = (_point(0, raw["fp8"]["speedup"], f"{here}: torch._scaled_mm vs bf16 at {raw['fp8']['shape']}")
                             if raw.get("fp8") else inherit(d["fp8_gemm_speedup"]))
    links = raw.get("links")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        if links:
            d["collectives"][op] = [_point(r["bytes"], r["busbw_gbs"], f"{here}: {op} over {raw['world_size']} ranks")
                                    for r in links[op]]
        else:
            d["collectives"][op] = [inherit(p) for p in d["collectives"][op]]
    d["inter_node"] = {op: inherit(p) for op, p in d["inter_node"].items()}
    d["host_us_per_layer"] = {k: inherit(p) for k, p in d["host_us_per_layer"].items()}
    d["fit"] = {"constants_from": f"the shipped {base.gpu} profile"}
    return profile_from_dict(d, "calibration")


def _calibrate_arg_problems(args: argparse.Namespace) -> list[str]:
    """``workbench calibrate``'s flags that cannot work, each with the flag and the fix (checked before anything starts)."""
    out = []
    if args.nproc is not None and args.nproc < 1:
        out.append(f"--nproc {args.nproc}: must be >= 1 -> e.g. --nproc 8 (default: every visible GPU)")
    if args.iters < 1:
        out.append(f"--iters {args.iters}: must be >= 1 timed repetition -> e.g. --iters 10 (the default)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        out.append(f"--timeout {args.timeout:g}: must be a finite number of seconds > 0 -> e.g. --timeout 600 (the default)")
    return out


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from workbench.advisor.profile import ProfileError, default_profile

    bad = _calibrate_arg_problems(args)
    if bad:
        for problem in bad:
            print(f"workbench calibrate: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.file)
        problems = cfg.validate()
        if problems:
            raise ConfigError(problems, args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.cpu:
        nproc, device = args.nproc or 2, "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            print("workbench calibrate: no CUDA GPU is visible -> run it on the GPU machine (or --cpu to check the machinery)",
                  file=sys.stderr)
            return 2
        nproc = args.nproc or torch.cuda.device_count()
        device = torch.cuda.get_device_name(0)
    gpu = args.gpu
    if gpu is None:
        from workbench.advisor.rows import device_gpu

        gpu = device_gpu(device) or "H100-80GB"
    try:
        spec = gpu_spec(gpu)
        base = default_profile(spec.name if spec.name in ("H100-80GB", "H200-141GB") else "H100-80GB")
    except (ValueError, ProfileError) as e:
        print(f"--gpu: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"calibration-{spec.name}.json")
    with tempfile.TemporaryDirectory(prefix="wb-calibrate-") as tmp:
        cfg_path = cfg.save(Path(tmp) / "config.json")
        raw_path = Path(tmp) / "raw.json"
        cmd = [*local_torchrun(nproc), "-m", "workbench.advisor.measure", "--config", str(cfg_path), "--out", str(raw_path),
               "--iters", str(args.iters)] + (["--cpu"] if args.cpu else [])
        env = dict(os.environ)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        try:  # the supervisor's tree is stopped (SIGTERM, then SIGKILL) before either exception reaches here
            res = run_supervised(cmd, Path(tmp) / "run", env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"workbench calibrate: the measuring ranks did not finish within --timeout {args.timeout:g} s and were "
                  f"stopped -> raise --timeout or lower --iters (now {args.iters})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("workbench calibrate: interrupted; the measuring ranks were stopped", file=sys.stderr)
            return 130
        if res.returncode != 0 or not raw_path.exists():
            print(f"workbench calibrate: the measuring ranks failed (exit {res.returncode}):\n{res.output[-3000:]}", file=sys.stderr)
            return 1
        raw = json.loads(raw_path.read_text())
    profile = profile_from_raw(raw, base, spec.name)
    profile.save(out)
    print(f"wrote {out}: {raw['device']}, {nproc} process(es); GEMM {', '.join(f'{p.value:.0f}' for p in profile.gemm_tflops)} TFLOP/s, "
          f"attention {profile.attention_tflops[0].value:.0f} TFLOP/s, copy {profile.memory_gbs.value:.0f} GB/s")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    a = subparsers.add_parser("advise", help="rank every valid layout of a config on N GPUs by predicted speed (fits/OOM from the planner)",
                              epilog="exit status: 0 some layout fits, 1 none fits, 2 bad config or arguments")
    a.add_argument("file", help="run config (JSON or YAML): the model, global batch and sequence to lay out")
    a.add_argument("--gpus", type=int, required=True, help="number of GPUs in all")
    a.add_argument("--gpu", default="H100-80GB", help="GPU model (memory and shipped profile): H100-80GB, H200-141GB")
    a.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (TP stays inside a node)")
    a.add_argument("--top", type=int, default=20, help="layouts that fit to show (memory is checked in order of speed)")
    a.add_argument("--profile", default=None, help="calibration profile JSON (default: the shipped one of --gpu)")
    fp8 = a.add_mutually_exclusive_group()
    fp8.add_argument("--fp8", dest="fp8", action="store_const", const=True, default=None,
                     help="list FP8 recipes too (default: only where the config asks for FP8 or committed rows measured "
                          "FP8 faster than bf16 for this model on --gpu)")
    fp8.add_argument("--no-fp8", dest="fp8", action="store_const", const=False,
                     help="leave FP8 recipes out (layouts in bf16 only), whatever the rows say")
    a.add_argument("--json", action="store_true", help="print every evaluated layout as JSON")
    a.set_defaults(func=_cmd_advise)
    c = subparsers.add_parser("calibrate", help="measure GEMM / attention / copy / optimizer rates and NCCL links on the visible GPUs",
                              epilog="exit status: 0 written, 1 the measuring ranks failed, 2 bad config or arguments")
    c.add_argument("file", help="run config whose shapes to measure at")
    c.add_argument("--out", default=None, help="profile JSON to write (default calibration-<gpu>.json)")
    c.add_argument("--nproc", type=int, default=None, help="processes (default: every visible GPU)")
    c.add_argument("--gpu", default=None, help="planner GPU name to record (default: from the device name)")
    c.add_argument("--iters", type=int, default=10, help="timed repetitions of each measurement")
    c.add_argument("--timeout", type=float, default=600.0, help="seconds before the measuring ranks are stopped")
    c.add_argument("--cpu", action="store_true", help="gloo on CPU with tiny sizes (checks the machinery; numbers mean nothing)")
    c.set_defaults(func=_cmd_calibrate)

