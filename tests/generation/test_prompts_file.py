"""``workbench generate --prompts-file`` (JSON lines) with a line that holds no prompt text (an object without
``"prompt"``, a null or a number) or an empty prompt exits 2 naming the file and the line, before any rank starts:
no ``KeyError`` traceback, no prompt ``"None"`` generated from."""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("line, said", [
    ('{"text": "the cat"}', "line 2 holds no prompt text"),
    ('{"prompt": null}', "line 2 holds no prompt text"),
    ("7", "line 2 holds no prompt text"),
    ('{"prompt": ""}', "prompts[1]: empty prompt"),
    ('"   "', "prompts[1]: empty prompt"),
])
def test_a_jsonl_line_without_prompt_text_exits_2_before_any_rank(gpt2_checkpoint, tmp_path, capsys, line, said):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "the cat"}\n' + line + "\n")
    rc, out = run_cli(["generate", "--ckpt", gpt2_checkpoint, "--prompts-file", f, "--device", "cpu", "--max-new-tokens", "1",
                    "--work-dir", tmp_path / "work"], capsys)
    assert rc == 2, out
    assert said in out and "Traceback" not in out, out
    assert not (tmp_path / "work").exists()  # no request written, no rank started
