"""A larger real-text corpus for the FP8-vs-bf16 loss curves, built here and carried to the GPU.

    python3 bench/loss_corpus.py --out .corpus          # needs a Debian mirror (apt-get download) and the workbench
    -> .corpus/loss_text.{bin,idx} (+ .workbench.json, the preprocess summary), .corpus/manifest.json

Why: the embedded corpus (KJV, about 1.07M tokens) is repeated 5 to 10 times by a 300-step curve at 16k-32k tokens
per step, and bf16's own run-to-run spread on it (1.46-2.30%, session 16) is as large as the 1.5% bar.  This one
holds about 12M tokens of three kinds of English prose, so a 300 x 32k-token curve reads each token about once:

- the Python 3.11 documentation's reStructuredText sources (Debian ``python3.11-doc``, PSF license);
- Perl's documentation, its POD files (Debian ``perl-doc``, GPL / Artistic);
- the embedded KJV corpus (public domain), one document per chapter.

One document per file (per chapter for the KJV), tokenized with the demo tokenizer (``workbench preprocess``, an
end-of-document token after each).  The manifest records the package versions and the sha256 of every output, which
the loss script copies into its rows (runs compare only on equal .bin / .idx hashes).  Nothing of it is committed (about 25 MB): rebuild it with this script.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"python3.11-doc": "usr/share/doc/python3.11/html/_sources/**/*.rst.txt", "perl-doc": "usr/share/perl/**/*.pod"}
PREFIX = "loss_text"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def documents(work: Path) -> tuple[list[str], dict]:
    """Every document's text, and what each package gave (version, files, characters)."""
    from workbench.data.demo import DEMO_CORPUS

    docs: list[str] = []
    info: dict = {}
    for pkg, pattern in PACKAGES.items():
        subprocess.run(["apt-get", "download", "-q", pkg], cwd=work, check=True, capture_output=True)
        deb = next(work.glob(f"{pkg}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
        files = sorted((work / "x").glob(pattern))
        texts = [f.read_text(encoding="utf-8", errors="replace").strip() for f in files]
        texts = [t for t in texts if t]
        docs += texts
        info[pkg] = {"deb": deb.name, "deb_sha256": sha256(deb), "files": len(texts), "chars": sum(map(len, texts))}
    kjv = [c.strip() for c in gzip.open(DEMO_CORPUS, "rt", encoding="utf-8").read().split("\n\n") if c.strip()]
    docs += kjv
    info["kjv"] = {"file": str(Path(DEMO_CORPUS).relative_to(ROOT)), "sha256": sha256(Path(DEMO_CORPUS)),
                   "files": len(kjv), "chars": sum(map(len, kjv))}
    return docs, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".corpus"))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wb-loss-corpus-") as tmp:
        work = Path(tmp)
        docs, info = documents(work)
        jsonl = work / "docs.jsonl"
        with open(jsonl, "w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps({"text": d}) + "\n")
        prefix = out / PREFIX
        subprocess.run([sys.executable, "-m", "workbench.cli", "preprocess", "--input", str(jsonl), "--output-prefix",
                        str(prefix), "--tokenizer", "demo", "--workers", str(a.workers), "--json", "-q"], check=True,
                       cwd=ROOT)
    outputs = sorted(p for p in out.iterdir() if p.name.startswith(PREFIX))
    summary = json.loads(next(p for p in outputs if p.name.endswith(".workbench.json")).read_text())
    manifest = {"prefix": PREFIX, "documents": len(docs), "sources": info,
                "tokens": summary.get("tokens") or summary.get("num_tokens"),
                "sha256": {p.name: sha256(p) for p in outputs}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
