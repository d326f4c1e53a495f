"""The event stream contract: writer/reader round trip, partial lines, late files, corrupt lines."""

from __future__ import annotations

import json

import pytest

from workbench.run.events import EventWriter, event_file
from workbench.run.reader import RunReader, read_events


def test_round_trip_across_ranks(tmp_path):
    with EventWriter(tmp_path, 0) as w0, EventWriter(tmp_path, 1) as w1:
        w0.emit("run_start", world_size=2, coords={"tp": 0, "pp": 0, "dp": 0})
        w1.emit("run_start", world_size=2, coords={"tp": 1, "pp": 0, "dp": 0})
        w1.emit("step", iteration=1, loss=5.5, mem_peak=123)
    events = read_events(tmp_path)
    assert [e["event"] for e in events].count("run_start") == 2
    step = [e for e in events if e["event"] == "step"][0]
    assert step["rank"] == 1 and step["loss"] == 5.5 and step["mem_peak"] == 123
    assert all("time" in e for e in events)


def test_partial_last_line_is_held_back_until_complete(tmp_path):
    f = RunReader(tmp_path)
    w = EventWriter(tmp_path, 0)
    w.emit("step", iteration=1, loss=1.0)
    line = json.dumps({"event": "step", "time": 2.0, "rank": 0, "iteration": 2, "loss": 0.5})
    path = event_file(tmp_path, 0)
    with open(path, "a") as fh:  # a writer caught mid-line
        fh.write(line[:17])
    first = f.poll()
    assert [e["iteration"] for e in first] == [1]
    assert f.poll() == []
    with open(path, "a") as fh:
        fh.write(line[17:] + "\n")
    second = f.poll()
    assert [e["iteration"] for e in second] == [2]
    w.close()


def test_late_rank_files_and_incremental_polls(tmp_path):
    f = RunReader(tmp_path)
    assert f.poll() == []  # no events dir yet
    EventWriter(tmp_path, 0).emit("step", iteration=1)
    assert len(f.poll()) == 1
    EventWriter(tmp_path, 3).emit("step", iteration=1)
    new = f.poll()
    assert [e["rank"] for e in new] == [3]


def test_corrupt_complete_line_is_counted_not_raised(tmp_path):
    path = event_file(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"event": "step", "iteration": 1}\n{broken\n{"event": "step", "iteration": 2}\n')
    f = RunReader(tmp_path)
    assert [e["iteration"] for e in f.poll()] == [1, 2]
    assert f.bad_lines == 1


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown event kind"):
        EventWriter(tmp_path, 0).emit("stpe")


def test_non_json_values_are_serialised(tmp_path):
    class Scalar:
        def item(self):
            return 4.25

    EventWriter(tmp_path, 0).emit("eval", iteration=3, loss=Scalar(), path=tmp_path)
    (e,) = read_events(tmp_path)
    assert e["loss"] == 4.25 and e["path"] == str(tmp_path)
