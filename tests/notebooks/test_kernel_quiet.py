"""What a notebook kernel shows of third-party noise: megatron-core's known import notes (Transformer Engine /
Apex missing, absl) are no pink stderr box (a real warning still is), and transformers' progress bars ("Loading
weights", "Writing model shards") are no widgets, which a saved and reopened notebook could no longer draw
("Error displaying widget: model not found").  A real ipykernel, as JupyterLab and papermill run one."""

from __future__ import annotations

import os
import queue
import textwrap
import time

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow


def _outputs(kc, msg_id: str, seconds: float) -> tuple[str, str, list[str]]:
    """(stdout, stderr, widget models opened) of one executed cell, until it is idle."""
    out, err, models = [], [], []
    end = time.time() + seconds
    while time.time() < end:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if kind == "stream":
            (err if content["name"] == "stderr" else out).append(content["text"])
        elif kind == "error":
            err.append("\n".join(content["traceback"]))
        elif kind == "comm_open":
            models.append(content["data"].get("state", {}).get("_model_name", "?"))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out), "".join(err), models
    raise AssertionError(f"the cell did not finish in {seconds}s; stderr so far: {''.join(err)[-2000:]}")


def test_a_kernel_shows_no_known_import_notes_and_no_transformers_progress_widgets(tmp_path):
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_HEADLESS", "PYTHONWARNINGS")}
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env={**env, "MPLBACKEND": "Agg"})
    try:
        code = textwrap.dedent(f'''
            import warnings
            import workbench
            import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs
            warnings.warn("an unrelated warning stays", UserWarning)
            from transformers import AutoModelForCausalLM
            from tests.support import hf_gpt2
            hf_gpt2().save_pretrained({str(tmp_path / "hf")!r})
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r})
            print("LOADED", type(model).__name__)
        ''')
        stdout, stderr, models = _outputs(kc, kc.execute(code), 600)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert "LOADED GPT2LMHeadModel" in stdout, (stdout, stderr)
    # megatron-core's known notes: nothing on stderr in a kernel (and no note in their place) ...
    assert "Transformer Engine" not in stderr and "Apex" not in stderr and "absl" not in stderr, stderr
    assert "[workbench] note" not in stderr, stderr
    # ... while a warning that is not on the list still shows
    assert "an unrelated warning stays" in stderr, stderr
    # transformers' progress bars: no widget (tqdm.auto's bar is an HBox of a FloatProgress) and no text bar
    assert "FloatProgressModel" not in models, models
    assert "Loading weights" not in stderr + stdout and "Writing model shards" not in stderr + stdout, stderr


def test_the_workbench_progress_bars_are_text_on_stdout_in_a_kernel(tmp_path):
    """The workbench's own bars (a conversion's, notebook 04; preprocessing's, notebook 06) are a text line on stdout
    in a kernel, which a reopened notebook still shows: no widget (tqdm.auto's would be a FloatProgress) and nothing on
    stderr (a pink box on a default run)."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_HEADLESS", "PYTHONWARNINGS")}
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env={**env, "MPLBACKEND": "Agg"})
    try:
        code = textwrap.dedent(f'''
            from pathlib import Path
            from tests.support import hf_gpt2
            from workbench.conversion import hf_to_megatron
            from workbench.data.preprocess import preprocess
            work = Path({str(tmp_path)!r})
            hf_gpt2().save_pretrained(work / "hf")
            res = hf_to_megatron(work / "hf", work / "megatron", device="cpu")
            (work / "a.txt").write_text("In the beginning.\\n\\nAnd the earth was without form.\\n", encoding="utf-8")
            summary = preprocess([work / "a.txt"], work / "corpus", tokenizer="demo")
            print("CONVERTED", res.checkpoint.name, "PREPROCESSED", summary.documents)
        ''')
        stdout, stderr, models = _outputs(kc, kc.execute(code), 600)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert "CONVERTED" in stdout and "PREPROCESSED 2" in stdout, (stdout, stderr)
    assert models == [], models
    assert stderr == "", stderr
    # replaced, not silenced: each bar's last state is a line of text on stdout
    assert "gpt2 -> mcore" in stdout and "preprocess corpus" in stdout, stdout
