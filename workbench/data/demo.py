"""The embedded demo corpus: real text that trains out of the box, with no download.

``corpus/kjv.txt.gz`` holds the King James Version of the Bible (public domain), one chapter per
document, documents separated by blank lines (see ``corpus/README.md``).  :func:`ensure_demo_dataset`
tokenizes it once with the demo tokenizer into a Megatron indexed dataset in a cache directory and
reuses it afterwards; the cache name carries a hash of the corpus and the tokenizer, so a changed
tokenizer never reads stale ids.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from workbench.data.errors import DataError

__all__ = ["CORPUS_DIR", "DEMO_CORPUS", "DEMO_MODELS", "DEMO_MODELS_TRAINER", "user_cache_dir", "demo_prefix",
           "ensure_demo_dataset"]

CORPUS_DIR = Path(__file__).parent / "corpus"
DEMO_CORPUS = CORPUS_DIR / "kjv.txt.gz"
#: the demo models the generation, BERT and T5 notebooks show, as Hugging Face directories (bf16) with provenance.json
DEMO_MODELS = CORPUS_DIR / "pretrained"
#: what makes them, from the repository's root (a maintainer's tool, not shipped with the package)
DEMO_MODELS_TRAINER = "tools/train_demo_models.py"
_DEMO_FORMAT = "1"


def user_cache_dir() -> Path:
    """``$WORKBENCH_CACHE``, else ``$XDG_CACHE_HOME/megatron-workbench``, else ``~/.cache/megatron-workbench``."""
    env = os.environ.get("WORKBENCH_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-workbench"


def _demo_key(tokenizer_sha: str) -> str:
    h = hashlib.sha256()
    h.update(_DEMO_FORMAT.encode())
    h.update(DEMO_CORPUS.read_bytes())
    h.update(tokenizer_sha.encode())
    return h.hexdigest()[:12]


def demo_prefix(cache_dir: str | Path | None = None, tokenizer="demo", split_sentences: bool = False) -> str:
    """Where the demo dataset lives (or will live): ``<cache>/demo/kjv-<hash>_text_document``.

    The hash covers the corpus and the tokenizer: the corpus can be tokenized with any tokenizer
    (``data.tokenizer``), each gets its own files.  ``split_sentences``: one sequence per sentence
    and no end-of-document token (what BERT reads), under ``kjv-sentences-<hash>``.
    """
    from workbench.data.tokenizer import load_tokenizer

    if not DEMO_CORPUS.is_file():
        raise DataError(str(DEMO_CORPUS), "the embedded demo corpus is missing from this install", "reinstall the workbench (pip install -e .)")
    tok = load_tokenizer(tokenizer)
    root = Path(cache_dir) if cache_dir else user_cache_dir()
    kind = "kjv-sentences" if split_sentences else "kjv"
    return str(root / "demo" / f"{kind}-{_demo_key(tok.unique_identifiers['sha'])}_text_document")


def ensure_demo_dataset(cache_dir: str | Path | None = None, progress: bool = False, workers: int = 1, tokenizer="demo",
                        split_sentences: bool = False) -> str:
    """Build the demo .bin/.idx if it is not cached yet; return its prefix. Safe to call repeatedly."""
    from workbench.data.indexed import check_indexed
    from workbench.data.preprocess import preprocess

    prefix = demo_prefix(cache_dir, tokenizer, split_sentences)
    try:
        check_indexed(prefix)
        return prefix
    except DataError:
        pass  # not built yet (or damaged): build it, one process at a time
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(prefix + ".lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # others (other runs, other ranks) wait here, then find it built
        except (ImportError, OSError):
            pass  # no advisory locks here: the atomic renames in preprocess still keep readers safe
        try:
            check_indexed(prefix)
            return prefix
        except DataError:
            pass
        preprocess([DEMO_CORPUS], prefix, tokenizer=tokenizer, append_eod=not split_sentences, workers=workers,
                   split_docs="blank-line", progress=progress, split_sentences=split_sentences)
    return prefix
