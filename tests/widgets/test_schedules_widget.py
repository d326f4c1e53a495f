"""The schedule explorer widget, driven headless the way a test or papermill would."""

from __future__ import annotations

import pytest

from workbench.schedules import operation_order


def test_sliders_drive_the_simulation():
    from workbench.widgets.schedule import ScheduleExplorer

    ex = ScheduleExplorer(p=4, m=8, v=2, schedule="interleaved", compare=True, show=False)
    assert ex.timeline.p == 4 and ex.timeline.v == 2
    assert ex.timeline.bubble_fraction() == pytest.approx(3 / 16)
    assert [t.schedule for t in ex.others] == ["1f1b", "gpipe"]
    assert len(ex.figure.axes) == 3

    ex.set(p=2, m=4, v=2, compare=False)
    assert [(o.kind, o.microbatch, o.chunk) for o in ex.timeline.ops[0]] == operation_order("interleaved", 2, 4, 2, 0)
    assert ex.others == [] and len(ex.figure.axes) == 1
    assert "0.125" in ex.status.value

    ex.p.value = 3  # a single slider move re-simulates too: m=4 is not a multiple of 3
    assert ex.timeline is None and ex.figure is None
    assert "multiple of 3" in ex.message and "refused" in ex.status.value

    ex.schedule.value = "1f1b"  # v is ignored (and disabled) outside interleaved
    assert ex.v.disabled and ex.timeline.v == 1
    assert ex.timeline.bubble_fraction() == pytest.approx(2 / 4)

    ex.set(ratio=1.0, latency=0.5)
    assert ex.timeline.backward == [1.0] * 3 and ex.timeline.latency == 0.5
