"""A single-machine SLURM cluster for the tests in this folder ("SLURM, for real").

- Debian's packages (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``; 22.05 on Debian 12),
  installed here with apt when missing and this is root (``apt-get update`` only when the install
  needs it); without root or apt the tests skip, saying so.
- Everything of the cluster lives in one private directory: its own munge key and ``munged``
  socket, ``slurm.conf`` (``SLURM_CONF``), state, spool, logs; free ports on 127.0.0.1.  Nothing
  under /etc is read or written, and any system munge or SLURM service is left alone.
- Two nodes on one machine: ``wb1`` and ``wb2``, two ``slurmd`` (``-N``) on their own ports, with
  ``NodeAddr=127.0.0.1``.  Debian's slurmd is built without ``--enable-multiple-slurmd``, which
  refuses two nodes with the SAME host name; each node here has its own name (the default
  ``NodeHostname``), so it works anyway.  Should the second node not come up, the two-node test
  skips and says why, and the one-node tests run on ``wb1``.
- The daemons run in the foreground as children of pytest (they die with it) and are stopped at
  the end of the module, after every job was cancelled: nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import apt_install, free_port
from workbench.launch.ownership import die_with_parent

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol", "munged"]
NODES = ["wb1", "wb2"]
KILL_WAIT = 30  # SLURM's seconds between SIGTERM and SIGKILL when a job is cancelled (its default)


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{tool}", os.X_OK)), None)


def _ensure_slurm() -> dict[str, str]:
    """Paths of the SLURM and munge programs; installs Debian's packages when they are missing."""
    missing = [t for t in TOOLS if not _which(t)]
    if missing:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing) and cannot be installed here (needs root "
                        f"and apt-get): apt-get install -y {' '.join(PACKAGES)}, then bash launch/test.sh tests/slurm")
        try:
            took = apt_install(PACKAGES, lambda: not [t for t in TOOLS if not _which(t)])
        except RuntimeError as e:
            pytest.fail(str(e))
        if took is not None:
            print(f"\ninstalled {' '.join(PACKAGES)} with apt-get in {took:.0f} s")
    paths = {t: _which(t) for t in TOOLS}
    gone = [t for t, p in paths.items() if not p]
    assert not gone, f"apt-get installed {' '.join(PACKAGES)} but {', '.join(gone)} is still missing"
    return paths


@dataclass
class Cluster:
    """The running test cluster (see the module docstring)."""

    root: Path
    conf: Path
    tools: dict[str, str]
    nodes: list[str]                       # the nodes that are up
    two_nodes_reason: str | None = None    # why the second node is not up (None: it is)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([self.tools[tool], *args], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}\n{self.logs()}")
        return r

    def queue(self) -> list[str]:
        """``squeue`` lines: "<job id> <state>" of every job the controller still lists as not done."""
        return self.run("squeue", "-h", "-o", "%i %T").stdout.split("\n")[:-1]

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return dict(zip(out[::2], out[1::2]))

    def logs(self, lines: int = 15) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)


def _write_conf(root: Path, cpus: int) -> Path:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN" for n in NODES)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# a two-node SLURM cluster on one machine, for tests/slurm (written by its conftest)
ClusterName=workbench
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
KillWait={KILL_WAIT}
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start(cluster: Cluster, name: str, cmd: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "wb")
    cluster.procs[name] = subprocess.Popen(cmd, env=cluster.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
    log.close()


def _wait(pred, timeout: float, poll: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return pred()


def _stop(cluster: Cluster, t0: float) -> None:
    """Cancel every job, wait for the queue to empty, stop the daemons; then any step daemon of ours left over."""
    import psutil

    try:
        if cluster.procs.get("slurmctld") is not None and cluster.procs["slurmctld"].poll() is None:
            cluster.run("scancel", "--partition=debug", check=False)
            _wait(lambda: not cluster.queue(), KILL_WAIT + 30)
    except Exception:
        pass
    for name in [*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged"]:
        p = cluster.procs.get(name)
        if p is None or p.poll() is not None:
            continue
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for p in psutil.process_iter(["name", "create_time"]):  # step daemons (slurmstepd) this cluster started
        try:
            if (p.info["name"] or "").startswith("slurmstepd") and p.info["create_time"] >= t0:
                p.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running single-machine SLURM cluster (:class:`Cluster`); ``SLURM_CONF`` points at it meanwhile."""
    if not hasattr(os, "geteuid"):
        pytest.skip("SLURM's daemons need Linux")
    tools = _ensure_slurm()
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root (SlurmUser=root): run the SLURM tests as root")
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="wb-slurm-"))  # short: slurmd's step sockets live under it
    for d in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cluster = Cluster(root, _write_conf(root, cpus), tools, nodes=[])
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # Run (squeue, scancel) and the CLI (sbatch) in this process
    try:
        m = root / "munge"
        _start(cluster, "munged", [tools["munged"], "-F", "-f", f"--key-file={key}", f"--socket={m}/munge.sock",
                                   f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={root}/log/munged.log"])
        if not _wait(lambda: (m / "munge.sock").exists() or cluster.procs["munged"].poll() is not None, 20) \
                or not (m / "munge.sock").exists():
            pytest.fail(f"munged did not start\n{cluster.logs()}")
        _start(cluster, "slurmctld", [tools["slurmctld"], "-D", "-f", str(cluster.conf)])
        if not _wait(lambda: cluster.procs["slurmctld"].poll() is not None
                     or cluster.run("sinfo", "-h", check=False).returncode == 0, 30):
            pytest.fail(f"slurmctld does not answer\n{cluster.logs()}")
        for n in NODES:
            _start(cluster, f"slurmd-{n}", [tools["slurmd"], "-D", "-f", str(cluster.conf), "-N", n])
        _wait(lambda: all(cluster.node_states().get(n) == "idle" for n in NODES), 30)
        states = cluster.node_states()
        cluster.nodes = [n for n in NODES if states.get(n) == "idle"]
        if NODES[0] not in cluster.nodes:
            pytest.fail(f"node {NODES[0]} did not come up (sinfo: {states})\n{cluster.logs()}")
        if NODES[1] not in cluster.nodes:
            p = cluster.procs[f"slurmd-{NODES[1]}"]
            why = "its slurmd exited" if p.poll() is not None else f"it is {states.get(NODES[1], 'unknown')!r} in sinfo"
            log = root / "log" / f"slurmd-{NODES[1]}.out"
            tail = " / ".join(log.read_text(errors="replace").splitlines()[-3:]) if log.exists() else ""
            cluster.two_nodes_reason = f"a second slurmd on this machine did not come up: {why} ({tail})"
        print(f"\nSLURM test cluster up in {time.time() - t0:.1f} s: nodes {cluster.nodes}, {cpus} CPUs each, SLURM_CONF={cluster.conf}")
        yield cluster
    finally:
        _stop(cluster, t0)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        shutil.rmtree(root, ignore_errors=True)
