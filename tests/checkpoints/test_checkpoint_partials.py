"""What a killed save leaves in a checkpoint root is tidied before the next save (``remove_stale_partials``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from workbench.checkpoint import METADATA_FILE, find_checkpoint, remove_stale_partials
from workbench.checkpoint.tree import _this_host


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _complete(d):
    d.mkdir(parents=True)
    (d / METADATA_FILE).write_text(json.dumps({"format": "workbench-mcore-v1", "iteration": int(d.name[5:12]), "complete": True}))
    return d


def test_unfinished_saves_of_dead_processes_go_live_ones_and_other_hosts_stay(tmp_path):
    dead, live, host = _dead_pid(), os.getpid(), _this_host()
    _complete(tmp_path / "iter_0000002")
    (tmp_path / f"iter_0000004.tmp-{host}-{dead}").mkdir()
    (tmp_path / f"iter_0000004.tmp-{host}-{dead}" / "__0_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / f"iter_0000005.tmp-{dead}").mkdir()  # the name before hosts were recorded: judged on this host
    (tmp_path / f"iter_0000006.tmp-{host}-{live}").mkdir()  # a save under way in a live process
    other = f"iter_0000008.tmp-gpu-node-17.cluster-{dead}"  # another machine's save on a shared filesystem
    (tmp_path / other).mkdir()
    done = remove_stale_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", f"iter_0000006.tmp-{host}-{live}", other]
    assert sum(line.startswith("removed") for line in done) == 2
    assert any(line.startswith(f"left {other}") and "gpu-node-17.cluster" in line for line in done)


def test_a_resave_killed_between_the_renames_gets_its_checkpoint_back(tmp_path):
    dead, host = _dead_pid(), _this_host()
    _complete(tmp_path / f"iter_0000004.old-{host}-{dead}")  # iter_4 was moved aside, the new copy never moved in
    (tmp_path / f"iter_0000004.tmp-{host}-{dead}").mkdir()
    done = remove_stale_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004"]
    assert find_checkpoint(tmp_path / "iter_0000004").name == "iter_0000004"
    assert any("restored iter_0000004" in line for line in done)
    # once the iteration is complete again, a leftover old copy is just removed
    _complete(tmp_path / f"iter_0000008.old-{host}-{dead}")
    _complete(tmp_path / "iter_0000008")
    assert any("removed iter_0000008.old" in line for line in remove_stale_partials(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000008"]
    assert remove_stale_partials(tmp_path) == []
