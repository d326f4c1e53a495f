"""Several checkpoint forwards in one launch: each rank runs ``workbench.conversion.verify``'s worker once per job.

``workbench.conversion.verify.forward_logits`` starts a supervised torchrun for every forward; most of its wall time
on the CPU machine is starting the ranks and importing torch and megatron-core in each (~5-7 s of CPU a process),
against well under a second for a tiny model's forward.  Tests that compare several checkpoints or layouts start the
ranks once here: every job is the verify module's own ``main`` (the same worker ``forward_logits`` launches: build
the chunks at the job's layout, load the checkpoint through megatron's resharding, forward, gather the logits), with
its own checkpoint, inputs and layout; between jobs megatron's model-parallel state is torn down and built again for
the next job's layout (the default process group is kept, as :mod:`tests.support.trainer_runs` does for training).

The launch's world is the largest job's ``tp x pp x ep``; a job with a smaller model-parallel layout runs with the
remaining ranks as data-parallel replicas (the model layout under test is the job's; only rank 0 of its data-parallel
group writes the logits).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from workbench.launch import local_torchrun, run_supervised

__all__ = ["forward_logits_many"]


DRIVER = r"""
import json, sys
from megatron.core import parallel_state
from workbench.backend import distributed
import workbench.conversion.verify as verify
destroy = distributed.destroy
distributed.destroy = parallel_state.destroy_model_parallel  # the worker's teardown: keep the default group
for argv in json.loads(open(sys.argv[1]).read()):
    verify.main(argv)
destroy()
"""


def forward_logits_many(jobs: list[dict[str, Any]], timeout: int = 600) -> list[Any]:
    """Logits (fp32, ``[b, s, padded_vocab]``) of each job, in order: a job is a dict of ``ckpt``, ``tokens`` (ids
    ``[b, s]`` or the family's dict of inputs) and optional ``tp``, ``pp``, ``vpp``, ``ep`` (as ``forward_logits``)."""
    import torch

    from workbench.checkpoint import safe_torch_load

    from workbench.conversion.verify import worker_argv, worker_env, worker_world

    world = max(worker_world(j.get("tp", 1), j.get("pp", 1), j.get("ep", 1)) for j in jobs)
    with tempfile.TemporaryDirectory(prefix="wb-verify-many-") as td:
        argvs, outs = [], []
        for i, j in enumerate(jobs):
            assert world % worker_world(j.get("tp", 1), j.get("pp", 1), j.get("ep", 1)) == 0, (world, j)
            tokens = j["tokens"]
            inputs = dict(tokens) if isinstance(tokens, dict) else {"tokens": tokens}
            tok, out = Path(td) / f"inputs-{i}.pt", Path(td) / f"logits-{i}.pt"
            torch.save({k: v.cpu() for k, v in inputs.items()}, tok)
            argvs.append(worker_argv(j["ckpt"], tok, out, j.get("tp", 1), j.get("pp", 1), j.get("vpp"), j.get("ep", 1)))
            outs.append(out)
        (Path(td) / "jobs.json").write_text(json.dumps(argvs))
        (Path(td) / "driver.py").write_text(DRIVER)
        env = {**worker_env(), "PYTHONWARNINGS": "ignore"}
        cmd = [*local_torchrun(world), str(Path(td) / "driver.py"), str(Path(td) / "jobs.json")]
        # under the supervisor, as forward_logits launches: a timed-out or killed launch leaves no rank behind
        res = run_supervised(cmd, Path(td) / "run", env=env, timeout=timeout)
        assert res.returncode == 0, "\n".join(res.output.splitlines()[-60:])
        return [safe_torch_load(str(o), source=str(o)) for o in outs]
