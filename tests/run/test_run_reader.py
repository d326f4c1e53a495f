"""The run contract: typed records, the one run-directory reader (incremental, corrupt and partial
lines), kernel path / layout accessors, and committed evidence runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workbench.run.events import (
    FUSION_PREFIX, Error, Eval, Event, EventWriter, Microbatch, RunEnd, RunStart, Step, event_file, fusion_entries,
    parse_line,
)
from workbench.run.files import atomic_output, free_port, read_json, write_json_atomic, write_text_atomic
from workbench.run.reader import RunReader, read_events

ROOT = Path(__file__).resolve().parents[2]


def _write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write("".join(lines))


def test_records_parse_to_their_types_and_keep_unknown_fields(tmp_path):
    kp = {"attention": "SDPA", **fusion_entries({"cuda_graphs": "layers", "cross_entropy": "compiled"})}
    with EventWriter(tmp_path, 0) as w:
        w.write(RunStart(config={"parallel": {"tensor_parallel": 2, "pipeline_parallel": 1}}, world_size=4,
                         coords={"tp": 0, "pp": 0, "dp": 0}, kernel_path=kp))
        w.write(Step(iteration=1, loss=2.5, mem_peak=7, extra={"aux loss": 0.1}))
        w.emit("microbatch", iteration=1, ops=[{"kind": "F", "microbatch": 0, "chunk": 0, "start_ms": 0.0, "end_ms": 1.0}])
        w.emit("eval", iteration=1, loss=2.0, ppl=7.4)
        w.emit("error", message="boom", exception="RuntimeError", new_field=3)
        w.emit("run_end", status="finished", iteration=1, seconds=1.0)
    r = RunReader(tmp_path)
    types = [type(x) for x in r.records()]
    assert types == [RunStart, Step, Microbatch, Eval, Error, RunEnd]
    step = r.records("step")[0]
    assert step.loss == 2.5 and step.mem_peak == 7 and step.rank == 0 and isinstance(step.time, float)
    assert step.extra == {"aux loss": 0.1} and step["aux loss"] == 0.1 and step.get("loss") == 2.5  # dict view too
    err = r.records("error")[0]
    assert err.exception_type == "RuntimeError" and err.extra["new_field"] == 3
    assert r.records("microbatch")[0].ops[0]["end_ms"] == 1.0
    # the dict view is the JSON object on disk
    assert read_events(tmp_path)[1]["aux loss"] == 0.1


def test_unknown_kind_on_disk_is_read_as_a_plain_event():
    rec = parse_line(b'{"event": "future_kind", "time": 1.0, "rank": 2, "x": 1}')
    assert type(rec) is Event and rec.event == "future_kind" and rec.extra == {"x": 1}
    assert parse_line(b"[1, 2]") is None and parse_line(b'{"no_event": 1}') is None and parse_line(b"") is None


def test_incremental_reading_and_partial_last_line(tmp_path):
    r = RunReader(tmp_path)
    assert r.poll() == []  # no events/ yet
    path = event_file(tmp_path, 0)
    line = json.dumps({"event": "step", "time": 2.0, "rank": 0, "iteration": 2})
    _write_lines(path, [json.dumps({"event": "step", "time": 1.0, "rank": 0, "iteration": 1}) + "\n", line[:20]])
    assert [e.iteration for e in r.poll()] == [1]
    assert r.poll() == []  # the partial line waits
    _write_lines(path, [line[20:] + "\n"])
    assert [e.iteration for e in r.poll()] == [2]
    _write_lines(event_file(tmp_path, 1), [json.dumps({"event": "step", "time": 3.0, "rank": 1, "iteration": 2}) + "\n"])
    assert [e.rank for e in r.poll()] == [1]  # a rank file that appears later
    assert [e.iteration for e in r.records("step", refresh=False)] == [1, 2, 2] and r.count == 3


def test_corrupt_line_in_the_middle_is_skipped(tmp_path):
    path = event_file(tmp_path, 0)
    good = [json.dumps({"event": "step", "time": float(i), "rank": 0, "iteration": i}) for i in range(1, 5)]
    torn = good[1][:15]  # a rank killed mid-line, then the run resumed into the same file
    _write_lines(path, [good[0] + "\n", "{broken\n", "\x00\x00garbage\n", torn + good[2] + "\n", good[3] + "\n"])
    r = RunReader(tmp_path)
    assert [e.iteration for e in r.records("step")] == [1, 3, 4]
    assert r.bad_lines == 3


def test_kernel_path_and_layout_accessors(tmp_path):
    cfg = {"parallel": {"tensor_parallel": 2, "pipeline_parallel": 2, "virtual_pipeline_parallel": 2}}
    with EventWriter(tmp_path, 1) as w1, EventWriter(tmp_path, 0) as w0:
        for g, w in ((0, w0), (1, w1)):
            w.write(RunStart(config=cfg, world_size=8, coords={"tp": g, "pp": 0, "dp": 0},
                             kernel_path={"attention": "SDPA", f"{FUSION_PREFIX}cuda_graphs": "layers"}))
    r = RunReader(tmp_path)
    assert r.kernel_path()["attention"] == "SDPA"
    assert r.fusions() == {"cuda_graphs": "layers"} and r.uses_cuda_graphs()
    lay = r.layout()
    assert (lay.tp, lay.pp, lay.dp, lay.vpp, lay.world_size) == (2, 2, 2, 2, 8)
    assert r.coords() == {0: {"tp": 0, "pp": 0, "dp": 0}, 1: {"tp": 1, "pp": 0, "dp": 0}}
    assert not RunStart(kernel_path={"attention": "SDPA"}).uses_cuda_graphs()


def test_run_directory_files(tmp_path):
    r = RunReader(tmp_path)
    assert r.launch_info() == {} and r.exit_status() is None and r.layout() is None
    write_json_atomic(tmp_path / "launch.json", {"supervisor_pid": 5})
    write_json_atomic(tmp_path / "exit_status.json", {"status": "finished"})
    write_json_atomic(tmp_path / "config.json", {"parallel": {"tensor_parallel": 1, "pipeline_parallel": 2, "nproc_per_node": 4}})
    assert r.launch_info()["supervisor_pid"] == 5 and r.exit_status()["status"] == "finished"
    assert (r.layout().pp, r.layout().dp) == (2, 2)


def test_a_context_parallel_runs_layout_counts_dp_without_cp(tmp_path):
    write_json_atomic(tmp_path / "config.json", {"parallel": {"tensor_parallel": 2, "context_parallel": 2,
                                                              "nproc_per_node": 8}})
    lay = RunReader(tmp_path).layout()
    assert (lay.tp, lay.cp, lay.dp, lay.world_size) == (2, 2, 2, 8)


@pytest.mark.parametrize("name", ["pp2", "pp2_vpp2"])
def test_committed_evidence_runs_still_load(name):
    run = next((d / name for d in (ROOT / "evidence" / "runs", ROOT / "tests" / "gpu_proofs" / "evidence" / "runs") if (d / name).is_dir()), None)
    if run is None:
        pytest.skip("evidence runs not in this checkout")
    r = RunReader(run)
    assert r.bad_lines == 0 and len(r.records("run_start")) == 2
    assert len(r.records("step")) == 100 and len(r.records("microbatch")) == 20
    assert all(isinstance(s, Step) and s.iteration for s in r.records("step"))
    assert r.layout().pp == 2 and r.layout().vpp == (2 if "vpp" in name else 1)
    assert r.kernel_path()  # the backend recorded its kernel path
    from workbench.schedules import load_measured

    ms = load_measured(r)  # the reader's records, not a second read
    assert ms.timeline.p == 2


def test_file_helpers(tmp_path):
    write_text_atomic(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"
    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "b.bin") as tmp:
            tmp.write_text("half")
            raise RuntimeError
    assert not (tmp_path / "b.bin").exists() and list(tmp_path.iterdir()) == [tmp_path / "a.txt"]
    assert read_json(tmp_path / "a.txt") is None and read_json(tmp_path / "missing.json") is None


def test_free_port_is_below_the_ephemeral_range_handed_in_turn_and_skips_a_listener(tmp_path, monkeypatch):
    """Ports come from below the range the OS gives outgoing connections (one of those took a rendezvous port between
    the pick and the bind), one after another through the counter file, never one someone listens on (on any
    address: a rendezvous store listens on all)."""
    import socket
    import tempfile

    from workbench.run import files

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))  # a private counter file, far from the wrap
    monkeypatch.setattr(files, "_ephemeral_floor", lambda: 32768)  # Linux's default range, whatever this host's is
    (tmp_path / f"workbench-ports-{os.getuid()}").write_text(str(files.PORT_FLOOR + 100))
    first = free_port()
    assert files.PORT_FLOOR + 100 < first < 32768
    with socket.socket() as listener:  # the next port that is free is taken, on every address
        taken = next(p for p in range(first + 1, first + 200) if files._bindable("127.0.0.1", p))
        listener.bind(("0.0.0.0", taken))
        listener.listen()
        second = free_port()
    assert second > taken  # skipped, and the ports before it are never handed out again until the wrap
    assert free_port() > second
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", second))

def test_run_contract_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, workbench.run, workbench.run.reader, workbench.run.events, workbench.run.files, "
            "workbench.run.writer, workbench.run.nodes; bad = [m for m in ('torch', 'megatron') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
