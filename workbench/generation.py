"""Text generation from workbench checkpoints: the light, notebook-side API and ``workbench generate``.

Everything here checks the request *before* any GPU process starts -- decoding options
through :meth:`workbench.config.GenerationConfig.validate`, then the prompts against the
checkpoint's tokenizer and the family's length rules (``Family.generation_rules``) -- and only then starts one process
per rank with torchrun, exactly like training::

    python -m workbench.launch.torchrun <one node, loopback> --nproc-per-node TP*PP -m workbench.rank.inference \\
        --ckpt DIR --request REQ.json --out OUT.json --tp TP --pp PP

(a single CPU/GPU process is started without torchrun), under the same supervisor as training
(:func:`workbench.launch.run_supervised`), so a killed caller leaves no rank behind.  The engine itself
(:mod:`workbench.rank.inference`) keeps megatron-core out of this module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from workbench.config import ConfigError, GenerationConfig, Problem
from workbench.families import family_of
from workbench.kernel_rule import SP_OVERLAP_FIELDS
from workbench.launch import local_torchrun, run_supervised
from workbench.checkpoint import CheckpointInfo, checkpoint_info  # noqa: F401
from workbench.data.tokenizer import resolve_tokenizer, special_ids, tokenizer_size  # noqa: F401
from workbench.run.files import write_json_atomic

__all__ = [
    "GenerationResult",
    "CheckpointInfo",
    "checkpoint_info",
    "resolve_tokenizer",
    "special_ids",
    "prepare_request",
    "generation_command",
    "layout_problems",
    "generate",
    "compare",
    "add_cli",
]


@dataclass
class GenerationResult:
    """One prompt's continuation: decoded text and token ids (prompt excluded)."""

    prompt: str | None
    text: str | None
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    log_probs: list[float] | None = None
    score: float | None = None


def prepare_request(info: CheckpointInfo, prompts: Sequence[str] | None, gen: GenerationConfig,
                    prompt_ids: Sequence[Sequence[int]] | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """Validate everything and tokenise; raises :class:`ConfigError` listing every problem.

    Returns the request the backend reads (token ids, so every rank sees the same prompts).
    """
    problems = list(gen.validate())
    m = info.config.model
    fam = family_of(info.config)
    if not fam.supports.generation:
        raise ConfigError([Problem("ckpt", f"{info.path} holds a {fam.title} model, which this generation path does not serve",
                                   "generate from a model family that supports it (see workbench.families)")])
    if gen.stop_token is not None and not 0 <= gen.stop_token < m.vocab_size:
        problems.append(Problem("generation.stop_token", f"{gen.stop_token} is not a token id of this model (vocab {m.vocab_size})",
                                f"use an id in [0, {m.vocab_size})"))
    if gen.top_k > m.vocab_size:
        problems.append(Problem("generation.top_k", f"top_k {gen.top_k} exceeds the vocabulary ({m.vocab_size})", f"use top_k <= {m.vocab_size}"))
    texts: list[str] | None = None
    if prompt_ids is None:
        if not prompts:
            problems.append(Problem("prompts", "no prompt given", "pass --prompt TEXT or --prompts-file FILE"))
            raise ConfigError(problems)
        texts = [str(p) for p in prompts]
        for i, p in enumerate(texts):
            if not p.strip():
                problems.append(Problem(f"prompts[{i}]", "empty prompt", "give some text to continue"))
        tokenizer = tokenizer if tokenizer is not None else resolve_tokenizer(info)
        if tokenizer is None:
            problems.append(Problem("ckpt", f"{info.path} records no tokenizer", "pass prompt token ids, or save the tokenizer with the checkpoint"))
            raise ConfigError(problems)
        ids = [list(tokenizer.encode(p)) if p.strip() else [] for p in texts]
        n_tok = tokenizer_size(tokenizer)
        if n_tok is not None and n_tok < m.vocab_size:  # said before anything runs, not discovered as empty text
            import warnings

            warnings.warn(f"the checkpoint's tokenizer ({getattr(tokenizer, 'name', type(tokenizer).__name__)}) has {n_tok} tokens "
                          f"but the model {m.vocab_size}: generated ids >= {n_tok} have no text and show as <id:N> "
                          f"-> use the model's own tokenizer", UserWarning, stacklevel=2)
    else:
        ids = [[int(t) for t in p] for p in prompt_ids]
        if not ids:
            problems.append(Problem("prompt_ids", "no prompt given", "pass at least one prompt"))
        for i, p in enumerate(ids):
            if not p:
                problems.append(Problem(f"prompts[{i}]", "empty prompt", "give at least one token"))
            bad = [t for t in p if not 0 <= t < m.vocab_size]
            if bad:
                problems.append(Problem(f"prompts[{i}]", f"token ids {bad[:3]} outside the vocabulary (size {m.vocab_size})", "check the tokenizer"))
    extra = 1 if gen.add_bos else 0
    for i, p in enumerate(ids):
        if not p:
            continue
        for where, rule, fix in fam.generation_rules(info.config, len(p) + extra, gen.max_new_tokens):
            problems.append(Problem(f"prompts[{i}]", rule, fix) if where == "prompt" else Problem(where, f"prompt {i} {rule}", fix))
    if problems:
        raise ConfigError(problems)
    return {"prompts": texts, "prompt_ids": ids, "generation": dataclasses.asdict(gen)}


def generation_command(ckpt: str | Path, request_path: str | Path, out_path: str | Path, *, tp: int, pp: int,
                       device: str, python: str | None = None) -> list[str]:
    """The exact command that runs generation: torchrun for several ranks, plain python for one."""
    python = python or sys.executable
    entry = ["-m", "workbench.rank.inference", "--ckpt", str(ckpt), "--request", str(request_path),
             "--out", str(out_path), "--tp", str(tp), "--pp", str(pp), "--device", device]
    world = tp * pp
    if world == 1:
        return [python, *entry]
    return [*local_torchrun(world, python=python), *entry]  # its stores on the loopback only


def _default_device(info: CheckpointInfo) -> str:
    if info.config.parallel.device == "cpu":
        return "cpu"
    try:
        import torch  # CUDA is only queried, never initialised for compute, in this process

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _visible_gpus() -> int:
    try:
        import torch  # counts devices without creating a CUDA context in this process

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001  (no torch / a broken driver: no usable GPU)
        return 0


def layout_problems(info: CheckpointInfo, tp: int, pp: int, device: str, vpp: int | None = None) -> list[Problem]:
    """Why running the model of ``info`` at ``tp`` x ``pp`` (``vpp`` chunks per stage) on ``device`` cannot work,
    before any process starts: the model's own rules for the layout (heads, query groups, FFN width divisible by
    tp; layers >= pp) and the device (a GPU per rank for 'cuda').  Generation and ``workbench convert verify``
    call it."""
    out: list[Problem] = []
    for name, v in (("tp", tp), ("pp", pp), ("vpp", vpp or 1)):
        if int(v) < 1:
            out.append(Problem(name, f"{name} is {v}", f"pass --{name} >= 1 (default: the checkpoint's)"))
    if out:
        return out
    over = {"parallel.nnodes": 1, "parallel.sequence_parallel": False, "parallel.recompute": "none", "parallel.device": device,
            "parallel.context_parallel": 1,  # generation's ranks load a CP checkpoint without CP (the backend does)
            # training's TP overlaps (they need SP, which generation runs without): not generation's to refuse
            **dict.fromkeys(SP_OVERLAP_FIELDS, False)}
    flags = {"parallel.pipeline_parallel": "pp", "parallel.virtual_pipeline_parallel": "vpp"}

    def rules(t: int, p: int, v: int | None) -> list[Problem]:
        c = info.config.replace(**over, **{"parallel.tensor_parallel": t, "parallel.pipeline_parallel": p,
                                           "parallel.virtual_pipeline_parallel": v, "parallel.nproc_per_node": t * p})
        return [x for x in c.validate() if x.field.startswith(("model.", "parallel."))]

    c = info.config.parallel
    base = {str(x) for x in rules(c.tensor_parallel, c.pipeline_parallel, None)}
    for x in rules(tp, pp, vpp if vpp and vpp > 1 else None):  # only what this layout breaks (the checkpoint's own loaded)
        if str(x) not in base:
            flag = flags.get(x.field, "tp")
            out.append(Problem(flag, f"{x.rule} ({x.field} at {flag} {dict(tp=tp, pp=pp, vpp=vpp)[flag]})",
                               f"{x.fix} (pass --{flag}; default: the checkpoint's {flag})"))
    if device == "cuda":
        gpus = _visible_gpus()
        if gpus == 0:
            out.append(Problem("device", "is 'cuda' but no CUDA GPU is visible on this machine",
                               "pass --device cpu (small models generate on CPU), or run on a GPU machine"))
        elif tp * pp > gpus:
            out.append(Problem("tp", f"tp {tp} x pp {pp} needs {tp * pp} GPUs, {gpus} visible",
                               f"use --tp/--pp with tp x pp <= {gpus}, or --device cpu"))
    return out


def _launch(info: CheckpointInfo, request: dict[str, Any], *, tp: int | None, pp: int | None, device: str | None,
            work_dir: str | Path | None, timeout: float | None, verbose: bool,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Check the layout, write the request, run one process per rank, return the backend's results JSON.

    ``progress``: called with one line as each phase starts (the process start, then the ranks' own lines:
    model parallel, building the model and loading the checkpoint, generating), while it runs.

    Without ``work_dir`` the request and output live in a temp directory removed afterwards (also on failure).
    """
    tp = info.config.parallel.tensor_parallel if tp is None else tp
    pp = info.config.parallel.pipeline_parallel if pp is None else pp
    device = device or _default_device(info)
    problems = layout_problems(info, tp, pp, device)
    if problems:
        raise ConfigError(problems)
    request["device"] = device
    own_tmp = not work_dir
    tmp = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="workbench-generate-"))
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        req_path, out_path = tmp / "request.json", tmp / "output.json"
        if progress is not None:  # the ranks append a line as each phase starts; echoed while they run
            request["progress"] = str((tmp / "progress.txt").absolute())
            (tmp / "progress.txt").unlink(missing_ok=True)
        write_json_atomic(req_path, request, indent=None)
        if out_path.exists():
            out_path.unlink()
        cmd = generation_command(info.path, req_path, out_path, tp=tp, pp=pp, device=device)
        if verbose:
            print("$", shlex.join(cmd), flush=True)
        if progress is not None:
            progress(f"starting {tp * pp} generation process(es) on {device} (tp {tp}, pp {pp}): importing torch and megatron-core")
        # the same supervised launch as training: if this process dies, the ranks go too
        with _echo_progress(tmp / "progress.txt", progress):
            proc = run_supervised(cmd, tmp, timeout=timeout, capture=not verbose)
        if proc.returncode != 0 or not out_path.exists():
            tail = proc.output[-4000:] if not verbose else ""
            raise RuntimeError(f"generation failed (exit code {proc.returncode}); command: {shlex.join(cmd)}\n{tail}")
        return json.loads(out_path.read_text())
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _echo_progress(path: Path, progress: Callable[[str], None] | None, interval: float = 0.2):
    """While the body runs, pass each new line of ``path`` (the ranks' progress file) to ``progress``."""
    if progress is None:
        yield
        return
    done = threading.Event()
    seen = 0

    def pump() -> None:
        nonlocal seen
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return
        for line in lines[seen:]:
            progress(line)
        seen = len(lines)

    def loop() -> None:
        while not done.wait(interval):
            pump()

    t = threading.Thread(target=loop, name="generate-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=5)
        pump()


def _results(texts: list[str] | None, n: int, outputs: list[dict]) -> list[GenerationResult]:
    texts = texts or [None] * n
    return [GenerationResult(prompt=t, text=o.get("text"), token_ids=o["token_ids"], prompt_ids=o["prompt_ids"],
                             finish_reason=o["finish_reason"], log_probs=o.get("log_probs"), score=o.get("score"))
            for t, o in zip(texts, outputs)]


def generate(ckpt: str | Path, prompts: Sequence[str] | str | None = None, gen: GenerationConfig | None = None, *,
             prompt_ids: Sequence[Sequence[int]] | None = None, tp: int | None = None, pp: int | None = None,
             device: str | None = None, work_dir: str | Path | None = None, timeout: float | None = None,
             verbose: bool = False, progress: Callable[[str], None] | None = None, **options: Any) -> list[GenerationResult]:
    """Generate continuations of ``prompts`` with the checkpoint's model, on its TP x PP layout.

    ``gen`` (or keyword options such as ``max_new_tokens=64, top_p=0.9``) sets the decoding.
    Bad input raises :class:`ConfigError` before any process starts.  ``progress``: called with a line as each
    phase starts (process start, model parallel, building the model and loading the checkpoint, generating).
    """
    gen = dataclasses.replace(gen or GenerationConfig(), **options) if options else (gen or GenerationConfig())
    return compare(ckpt, prompts, {"default": gen}, prompt_ids=prompt_ids, tp=tp, pp=pp, device=device,
                   work_dir=work_dir, timeout=timeout, verbose=verbose, progress=progress)["default"]


def compare(ckpt: str | Path, prompts: Sequence[str] | str | None, configs: dict[str, GenerationConfig], *,
            prompt_ids: Sequence[Sequence[int]] | None = None, tp: int | None = None, pp: int | None = None,
            device: str | None = None, work_dir: str | Path | None = None, timeout: float | None = None,
            verbose: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, list[GenerationResult]]:
    """Several decoding configs on the same prompts, the model loaded once: {name: results}.

    Every config is validated (each problem prefixed with its name) before anything starts.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not configs:
        raise ConfigError([Problem("configs", "no decoding config given", "pass {name: GenerationConfig(...)}")])
    info = checkpoint_info(ckpt)
    problems: list[Problem] = []
    request: dict[str, Any] | None = None
    tokenizer = None
    for name, gen in configs.items():
        try:
            if tokenizer is None and prompt_ids is None:
                tokenizer = resolve_tokenizer(info)
            r = prepare_request(info, prompts, gen, prompt_ids=prompt_ids, tokenizer=tokenizer)
            request = request or r
        except ConfigError as e:
            prefix = "" if len(configs) == 1 else f"[{name}] "
            problems += [Problem(prefix + p.field, p.rule, p.fix) for p in e.problems]
    if problems or request is None:
        raise ConfigError(problems)
    request.pop("generation", None)
    request["runs"] = {name: dataclasses.asdict(gen) for name, gen in configs.items()}
    data = _launch(info, request, tp=tp, pp=pp, device=device, work_dir=work_dir, timeout=timeout, verbose=verbose,
                   progress=progress)
    n = len(request["prompt_ids"])
    return {name: _results(request["prompts"], n, data["runs"][name]["outputs"]) for name in configs}


# --------------------------------------------------------------------------- CLI


def _gen_from_args(args: argparse.Namespace) -> GenerationConfig:
    g = GenerationConfig()
    kw: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "greedy": args.greedy, "add_bos": args.add_bos,
                          "return_log_probs": args.log_probs}
    for name in ("top_k", "top_p", "top_p_decay", "top_p_bound", "temperature", "num_beams", "length_penalty",
                 "stop_token", "seed"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    return dataclasses.replace(g, **kw)


def _stderr_line(line: str) -> None:
    print(f"generate: {line}", file=sys.stderr, flush=True)


def _cli_generate(args: argparse.Namespace) -> int:
    prompts: list[str] = list(args.prompt or [])
    if args.prompts_file:
        f = Path(args.prompts_file)
        if not f.is_file():
            print(f"--prompts-file {f}: file not found -> check the path", file=sys.stderr)
            return 2
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text().splitlines()):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        print(f"--prompts-file {f}: line {i + 1} is not JSON -> one JSON string or {{\"prompt\": ...}} per line", file=sys.stderr)
                        return 2
                    prompt = obj.get("prompt") if isinstance(obj, dict) else obj
                    if not isinstance(prompt, str):
                        print(f"--prompts-file {f}: line {i + 1} holds no prompt text ({line.strip()[:60]}) -> one JSON string "
                              "or {\"prompt\": \"text\"} per line", file=sys.stderr)
                        return 2
                    prompts.append(prompt)
        else:
            prompts += [line for line in f.read_text().splitlines() if line.strip()]
    if args.prompt is None and not args.prompts_file:
        print("give --prompt TEXT (repeatable) or --prompts-file FILE", file=sys.stderr)
        return 2
    try:
        gen = _gen_from_args(args)
        # a line on stderr as each phase starts (several seconds pass before any output); stdout keeps the results
        results = generate(args.ckpt, prompts, gen, tp=args.tp, pp=args.pp, device=args.device,
                           work_dir=args.work_dir, verbose=args.verbose, progress=_stderr_line)
    except ValueError as e:  # ConfigError, CheckpointError, DataError: bad input, nothing started
        print(e, file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"--- prompt: {r.prompt!r}")
            print(f"{r.prompt or ''}{r.text or ''}")
            print(f"    [{len(r.token_ids)} tokens, {r.finish_reason}{'' if r.score is None else f', score {r.score:.3f}'}] ids={r.token_ids}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (greedy, top-k, top-p, beam search)",
                       description="Generate with the checkpoint's model on its TP/PP layout (torchrun, one process per rank).")
    p.add_argument("--ckpt", required=True, help="checkpoint root or iter_XXXXXXX directory")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="one prompt per line (.txt) or JSON lines (.jsonl)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding")
    mode.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    mode.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    p.add_argument("--top-p-decay", type=float, default=None, help="multiply top-p by this after every token (Megatron)")
    p.add_argument("--top-p-bound", type=float, default=None, help="lower bound for the decayed top-p")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--num-beams", type=int, default=None, help="beam search (HF semantics)")
    p.add_argument("--length-penalty", type=float, default=None, help="beam score = log-prob / length**penalty")
    p.add_argument("--add-bos", action="store_true", help="prepend the tokenizer's BOS (or EOS) token")
    p.add_argument("--stop-token", type=int, default=None, help="stop a sequence at this token id (as at EOS)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same tokens at any TP)")
    p.add_argument("--log-probs", action="store_true", help="return each generated token's log-probability")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: the checkpoint's)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: the checkpoint's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--work-dir", default=None, help="where request/output JSON go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--verbose", action="store_true", help="show the command and the ranks' output")
    p.set_defaults(func=_cli_generate)
