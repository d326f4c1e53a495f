"""Preprocessing throughput: tokens/s of ``workbench preprocess`` at 1 and N worker processes.

Input: the embedded demo corpus (4.2 MB of text, 1,189 documents), repeated ``--repeat`` times
into one plain-text file so process start-up is amortised; tokenizer: ``--tokenizer`` (demo).
Each worker count runs ``--trials`` times (best kept, all recorded), writing a real
``.bin``/``.idx`` with megatron-core's builder each time, and the outputs of every worker count
are checked byte-identical to the 1-worker output (parallelism must never change the data).

Appends one JSON line per worker count to ``--out`` (default
``bench/results/preprocess_throughput.jsonl``): device (CPU model), cpu_count, date, git_commit,
workers, documents, tokens, bytes, seconds (best wall), tokens_per_s, MB_per_s, speedup_vs_1, and
cpu_seconds / tokens_per_cpu_s (this process + its workers) with the 1-minute load average: on a
shared machine the wall-clock numbers carry other processes' load, the CPU numbers do not.

    python bench/preprocess_throughput.py                 # workers 1 and os.cpu_count()
    python bench/preprocess_throughput.py --workers 1 2 4 --repeat 4
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _git_commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default: 1 and os.cpu_count())")
    ap.add_argument("--repeat", type=int, default=2, help="copies of the corpus in the input (default 2: ~8.5 MB, ~2.1M tokens)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--tokenizer", default="demo")
    ap.add_argument("--limit-docs", type=int, default=None, help="use only the first N chapters (a quick smoke run; CI)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "preprocess_throughput.jsonl"))
    a = ap.parse_args(argv)

    from workbench.data.demo import DEMO_CORPUS
    from workbench.data.preprocess import preprocess, token_dtype
    from workbench.data.tokenizer import load_tokenizer

    tok = load_tokenizer(a.tokenizer)  # loaded once, outside the timings
    token_dtype(tok.vocab_size)  # imports megatron-core (seconds) outside the timings

    cpus = os.cpu_count() or 1
    commit = _git_commit()  # once: others may commit while the benchmark runs
    counts = a.workers or sorted({1, cpus})
    text = gzip.open(DEMO_CORPUS, "rt", encoding="utf-8").read().rstrip("\n")
    if a.limit_docs:
        text = "\n\n".join(text.split("\n\n")[: a.limit_docs])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.txt"
        src.write_text("\n\n".join([text] * a.repeat) + "\n", encoding="utf-8")
        reference: dict[str, bytes] | None = None
        base_tps = None
        for w in counts:
            best = None
            trials = []
            for t in range(a.trials):
                prefix = Path(tmp) / f"w{w}_{t}"
                t0 = os.times()
                s = preprocess([src], prefix, tokenizer=tok, workers=w, progress=False)
                t1 = os.times()
                # CPU seconds of this process and its (joined) workers: unaffected by other load on the machine
                s.cpu_seconds = (t1.user - t0.user) + (t1.system - t0.system) + (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
                trials.append(round(s.seconds, 4))
                if best is None or s.seconds < best.seconds:
                    best = s
                out = {suf: Path(f"{prefix}{suf}").read_bytes() for suf in (".bin", ".idx")}
                if reference is None:
                    reference = out
                elif out != reference:
                    print(f"error: {w} workers produced different .bin/.idx bytes than 1 worker", file=sys.stderr)
                    return 1
                for suf in (".bin", ".idx", ".workbench.json"):
                    Path(f"{prefix}{suf}").unlink(missing_ok=True)
            tps = best.tokens_per_s
            base_tps = base_tps or (tps if w == counts[0] else None)
            row = {
                "bench": "preprocess_throughput", "device": _cpu_name(), "cpu_count": cpus,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": commit,
                "tokenizer": a.tokenizer, "workers": w, "documents": best.documents, "tokens": best.tokens, "bytes": best.bytes,
                "seconds": round(best.seconds, 4), "trials_seconds": trials, "tokens_per_s": round(tps, 1),
                "cpu_seconds": round(best.cpu_seconds, 3), "tokens_per_cpu_s": round(best.tokens / best.cpu_seconds, 1),
                "loadavg_1m": round(os.getloadavg()[0], 2),
                "MB_per_s": round(best.bytes / best.seconds / 1e6, 3),
                "speedup_vs_1": round(tps / base_tps, 3) if base_tps and counts[0] == 1 else None,
            }
            rows.append(row)
            speedup = "" if row["speedup_vs_1"] is None else f"  x{row['speedup_vs_1']:.2f} vs 1 worker"
            print(f"workers {w:>2}: {best.tokens:,} tokens in {best.seconds:6.2f} s = {tps:>12,.0f} tokens/s "
                  f"({row['MB_per_s']:.2f} MB/s){speedup}; {row['tokens_per_cpu_s']:,.0f} tokens per CPU-second, "
                  f"load {row['loadavg_1m']}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    print(f"appended {len(rows)} line(s) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
