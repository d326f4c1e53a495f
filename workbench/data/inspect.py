"""Looking at an indexed dataset: counts, the document-length distribution, decoded samples.

Reads through megatron-core's own ``IndexedDataset`` (after :func:`check_indexed` has vouched for
the files), so what you see is what training will read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.data.errors import DataError

__all__ = ["DatasetReport", "inspect_dataset", "plot_lengths", "read_documents"]


@dataclass
class DatasetReport:
    prefix: str
    dtype: str
    documents: int
    sequences: int
    tokens: int
    length_min: int
    length_mean: float
    length_median: float
    length_p95: float
    length_max: int
    hist_counts: list[int]
    hist_edges: list[float]
    tokenizer: str | None
    samples: list[dict] = field(default_factory=list)  # {index, length, ids (first 32), text}
    sidecar: dict | None = None
    #: sentence-split data (``preprocess --split-sentences``, what BERT reads): sequences are sentences
    split_sentences: bool = False
    sentences_per_document_mean: float | None = None
    documents_with_two_sentences: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"{self.prefix}  ({self.dtype})",
                 f"  documents {self.documents:,}  sequences {self.sequences:,}  tokens {self.tokens:,}",
                 f"  tokens/document: min {self.length_min}  mean {self.length_mean:.1f}  median {self.length_median:.0f}  "
                 f"p95 {self.length_p95:.0f}  max {self.length_max}"]
        if self.split_sentences:
            lines[2] = lines[2].replace("tokens/document", "tokens/sentence")
            lines.append(f"  sentence-split: {self.sentences_per_document_mean:.1f} sentences/document; "
                         f"{self.documents_with_two_sentences:,} of {self.documents:,} documents have >= 2 (BERT's binary head needs them)")
        if self.sidecar:
            tk = (self.sidecar.get("tokenizer") or {}).get("name")
            lines.append(f"  made by workbench preprocess with tokenizer {tk!r}, append_eod={self.sidecar.get('append_eod')}")
        peak = max(self.hist_counts) if self.hist_counts else 0
        lines.append("  length histogram:")
        for c, lo, hi in zip(self.hist_counts, self.hist_edges[:-1], self.hist_edges[1:]):
            bar = "#" * (int(round(40 * c / peak)) if peak else 0)
            lines.append(f"    {lo:>9.0f} - {hi:<9.0f} {c:>8}  {bar}")
        for s in self.samples:
            lines.append(f"  --- {'sentence' if self.split_sentences else 'document'} {s['index']} ({s['length']} tokens)")
            if s.get("text") is not None:
                text = s["text"] if len(s["text"]) <= 400 else s["text"][:400] + " ..."
                lines.append("    " + text.replace("\n", "\n    "))
            else:
                lines.append(f"    ids: {s['ids']}")
        return "\n".join(lines)


def read_documents(prefix: str | Path):
    """megatron-core's ``IndexedDataset`` for a checked prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from workbench.data.indexed import check_indexed

    import warnings

    info = check_indexed(prefix)
    with warnings.catch_warnings():  # megatron-core's rank lookup warns outside torchrun
        warnings.filterwarnings("ignore", message="Could not determine rank")
        return IndexedDataset(info.prefix)


def inspect_dataset(prefix: str | Path, tokenizer=None, samples: int = 3, bins: int = 20, seed: int = 0) -> DatasetReport:
    """Summarise ``PREFIX.bin/.idx``; decode ``samples`` random documents when a tokenizer is known."""
    import numpy as np

    from workbench.data.indexed import check_indexed, read_sidecar
    from workbench.data.tokenizer import load_tokenizer

    info = check_indexed(prefix)
    meta = read_sidecar(info.prefix)
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif meta and (meta.get("tokenizer") or {}).get("name"):
        try:
            tok = load_tokenizer(meta["tokenizer"]["name"])
        except DataError:
            tok = None  # recorded tokenizer no longer available: show ids
    ds = read_documents(info.prefix)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    if lengths.size == 0:
        raise DataError(info.prefix + ".idx", "the dataset holds no documents", "re-run workbench preprocess on non-empty inputs")
    counts, edges = np.histogram(lengths, bins=min(bins, max(int(lengths.size), 1)))
    rng = np.random.default_rng(seed)
    picks = sorted(rng.choice(lengths.size, size=min(samples, lengths.size), replace=False).tolist()) if samples > 0 else []
    out = []
    for i in picks:
        ids = ds[i].tolist()
        out.append({"index": int(i), "length": len(ids), "ids": ids[:32], "text": tok.decode(ids) if tok is not None else None})
    doc_idx = np.asarray(ds.document_indices, dtype=np.int64)
    per_doc = np.diff(doc_idx) if doc_idx.size > 1 else np.zeros(0, np.int64)
    split = bool((meta or {}).get("split_sentences")) or info.sequences != info.documents
    return DatasetReport(
        split_sentences=split, sentences_per_document_mean=float(per_doc.mean()) if split and per_doc.size else None,
        documents_with_two_sentences=int((per_doc >= 2).sum()) if split else None,
        prefix=info.prefix, dtype=info.dtype, documents=info.documents, sequences=info.sequences, tokens=info.tokens,
        length_min=int(lengths.min()), length_mean=float(lengths.mean()), length_median=float(np.median(lengths)),
        length_p95=float(np.percentile(lengths, 95)), length_max=int(lengths.max()),
        hist_counts=[int(c) for c in counts], hist_edges=[float(e) for e in edges],
        tokenizer=tok.name if tok is not None else None, samples=out, sidecar=meta,
    )


def plot_lengths(report: DatasetReport, path: str | Path | None = None):
    """Histogram of tokens per document; saved to ``path`` when given. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    edges = report.hist_edges
    widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
    ax.bar(edges[:-1], report.hist_counts, width=widths, align="edge", edgecolor="black", linewidth=0.4)
    ax.axvline(report.length_mean, color="tab:red", linestyle="--", label=f"mean {report.length_mean:.0f}")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.set_title(f"{Path(report.prefix).name}: {report.documents:,} documents, {report.tokens:,} tokens")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
