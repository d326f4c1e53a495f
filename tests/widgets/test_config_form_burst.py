"""The config form reaches the browser whole: what it sends when shown stays well under the kernel's IOPub limit.

Every widget is a ``comm_open`` message from the kernel, every later change a ``comm_msg``; ipykernel's IOPub socket
(ZMQ PUB, default send high-water mark 1000 messages) silently drops what a slow browser has not read yet.  The
quickstart form once sent 983 opens and 179 updates in one burst, and on a loaded machine JupyterLab never got the
last widgets (the form's own box among them: the cell showed nothing).  The kernel's comm is the boundary recorded
here (``comm.create_comm``): no kernel runs.
"""

from __future__ import annotations

import collections

import pytest

comm = pytest.importorskip("comm")

ZMQ_HWM = 1000  # ZMQ's default SNDHWM, which ipykernel's IOPub socket keeps


@pytest.fixture
def sent(monkeypatch):
    from comm.base_comm import BaseComm

    counts: collections.Counter = collections.Counter()

    class Recording(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            counts[msg_type] += 1

    monkeypatch.setattr(comm, "create_comm", lambda **kw: Recording(**kw))
    return counts


def test_the_quickstart_form_arrives_in_a_burst_well_under_iopubs_limit(sent):
    from workbench.config import RunConfig
    from workbench.notebook import quickstart_config
    from workbench.widgets.config_form import ConfigForm

    cfg, _note = quickstart_config("demo-small", tp=1, pp=1, steps=6)
    form = ConfigForm(cfg=cfg)
    total = sent["comm_open"] + sent["comm_msg"]
    # a field costs ~4.5 messages (its widget, its message line, its row and the row's layout): a form that grows
    # past 0.8 of the mark needs fewer per field (e.g. rows created hidden), not a higher bar here
    assert total < 0.8 * ZMQ_HWM, dict(sent)
    assert total < 5 * len(form.fields), dict(sent)
    assert sent["comm_msg"] < len(form.fields) / 2  # the fields start at the config's values: few updates after
    # what the form shows is still the config, and each row hides on its own
    assert RunConfig.from_dict(form.config.to_dict()).to_dict() == cfg.to_dict()
    rows = list(form.rows.values())
    assert len({id(r.layout) for r in rows}) == len(rows)

