"""docs/advisor.md against what Megatron-Bridge published: its performance summary lists DGX-H100 FP8 throughput for
the two recipes the page compares with (Llama3-8B on 8 GPUs 14,451 tokens/s/GPU, Llama3-70B on 64 GPUs 1,602), so
the page quotes them, and the gaps it states follow from the predictions it quotes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = {"8B": 14_451, "70B": 1_602}  # tokens/s/GPU, DGX-H100, FP8 (Megatron-Bridge performance summary)


def test_advisor_doc_quotes_bridge_dgx_h100_numbers_and_consistent_gaps():
    text = " ".join((ROOT / "docs" / "advisor.md").read_text(encoding="utf-8").split())
    assert "listed no DGX-H100" not in text and "no Bridge throughput is quoted" not in text
    assert "Llama3-8B on 8 GPUs 14,451 tokens/s/GPU" in text and "Llama3-70B on 64 GPUs 1,602 tokens/s/GPU" in text
    gaps = re.search(r"are (\d+)% \(8B: ([\d,]+)\) and (\d+)% \(70B: ([\d,]+)\) under those", text)
    assert gaps, "the page no longer states the advisor's FP8 predictions against Bridge's"
    for pct, pred, model in ((gaps.group(1), gaps.group(2), "8B"), (gaps.group(3), gaps.group(4), "70B")):
        assert round(100 * (1 - int(pred.replace(",", "")) / PUBLISHED[model])) == int(pct), (model, pct, pred)
        assert f"{int(pred.replace(',', '')):,}" in text.split("| with `--fp8` |", 1)[1], (model, pred)
