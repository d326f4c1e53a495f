"""FP8 in the advisor follows the measurements: FP8 layouts are opt-in (``--fp8``, or a config that asks for FP8)
unless committed rows measured FP8 faster than bf16 for the same model on the same GPU; ``--no-fp8`` stays accepted
as the explicit form of leaving them out.  docs/advisor.md states the same rule and the same flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workbench.advisor import advise
from workbench.advisor.rows import fp8_measured_faster
from workbench.cli import build_parser, main
from workbench.config import preset

ROOT = Path(__file__).resolve().parents[2]


def fp8_rows(adv) -> list:
    return [r for r in adv.rows if r.layout.fp8 != "off"]


def test_fp8_left_out_where_its_rows_are_slower():
    """GPT-2 medium on H100: its FP8 rows measured slower than its bf16 row, so the default lists no FP8 layout."""
    cfg = preset("gpt2-medium")
    faster, why = fp8_measured_faster(cfg, "H100-80GB")
    assert not faster and "gpt2-medium on H100-80GB" in why and "bench/results/" in why
    adv = advise(cfg, 1, top=None)
    assert adv.rows and not fp8_rows(adv)
    assert any(n.startswith("FP8 layouts left out (opt-in: --fp8 includes them)") for n in adv.notes), adv.notes
    assert fp8_rows(advise(cfg, 1, top=None, fp8=True))


def test_fp8_included_where_its_rows_are_faster():
    """Llama-3.2-1B on H100: the committed FP8 rows beat bf16, so FP8 layouts are listed without --fp8."""
    cfg = preset("llama3.2-1b", **{"train.global_batch_size": 8})
    faster, why = fp8_measured_faster(cfg, "H100-80GB")
    assert faster and "llama3.2-1b on H100-80GB" in why
    adv = advise(cfg, 1, top=3)
    assert fp8_rows(adv) and any(n.startswith("FP8 layouts included: measured faster") for n in adv.notes)
    assert not fp8_rows(advise(cfg, 1, top=3, fp8=False))


def test_unmeasured_model_is_bf16_unless_the_config_asks_for_fp8():
    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 8, "model.num_layers": 4})  # no committed row of this shape
    assert fp8_measured_faster(cfg, "H100-80GB") == (False, "no committed FP8 measurement of this model on H100-80GB")
    assert not fp8_rows(advise(cfg, 1, top=1))
    asks = advise(cfg.replace(**{"train.fp8": "tensorwise"}), 1, top=None)
    assert fp8_rows(asks) and any("the config asks for train.fp8: tensorwise" in n for n in asks.notes)


def _row(variant: str, tok_s: float, date: str = "2026-01-01") -> str:
    return json.dumps({"variant": f"{variant}/gpt2-small", "kind": "workbench", "model": "gpt2-small", "gpus": 1, "ok": True,
                       "device": "NVIDIA H100 80GB HBM3", "date": date, "tokens_per_s": tok_s, "seq_length": 1024,
                       "micro_batch_size": 8, "global_batch_size": 32})


@pytest.mark.parametrize("fp8_tok_s, faster", [(90.0, False), (110.0, True)])
def test_the_rule_compares_the_newest_bf16_and_fp8_rows(tmp_path, fp8_tok_s, faster):
    rows = tmp_path / "bench" / "results" / "train_throughput.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text("\n".join([_row("workbench", 200.0, "2025-01-01"), _row("workbench", 100.0),
                               _row("workbench-fp8-tensorwise", 500.0, "2025-01-01"), _row("workbench-fp8-tensorwise", fp8_tok_s)]))
    got, why = fp8_measured_faster(preset("gpt2-small"), "H100-80GB", root=tmp_path)
    assert got is faster and "bf16 100" in why and f"{fp8_tok_s:,.0f} tok/s" in why
    assert fp8_measured_faster(preset("gpt2-small"), "H200-141GB", root=tmp_path)[0] is False  # another GPU's rows


def test_cli_flags_and_docs_agree(tmp_path, capsys):
    path = preset("gpt2-medium").save(tmp_path / "run.json")
    counts = {}
    for flag in ([], ["--no-fp8"], ["--fp8"]):
        assert main(["advise", str(path), "--gpus", "1", "--top", "1", "--json", *flag]) == 0
        counts[" ".join(flag)] = json.loads(capsys.readouterr().out)["valid_layouts"]
    assert counts[""] == counts["--no-fp8"] < counts["--fp8"], counts  # the default is --no-fp8's bf16 layouts here
    with pytest.raises(SystemExit):
        main(["advise", str(path), "--gpus", "1", "--fp8", "--no-fp8"])
    advise_parser = build_parser()._subparsers._group_actions[0].choices["advise"]
    flags = {o for a in advise_parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    doc = (ROOT / "docs" / "advisor.md").read_text()
    usage = re.search(r"^`workbench advise CONFIG ([^`]*)`", doc, re.M)
    assert usage and set(re.findall(r"--[a-z0-9-]+", usage.group(1))) == flags
    assert "**FP8 is opt-in.**" in doc and "`--fp8`" in doc
