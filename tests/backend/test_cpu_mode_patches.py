"""CPU mode's CUDA stand-ins keep the names' kinds: code that imports after them still works."""

import torch

from workbench.backend import cpu_mode


def test_the_stream_stand_in_is_a_class_usable_in_type_expressions():
    cpu_mode.enable()
    try:
        assert isinstance(torch.cuda.Stream, type)
        hint = torch.cuda.Stream | None  # transformers' generation utilities evaluate this at import
        assert hint is not None
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            s.wait_stream(torch.cuda.current_stream())
        assert s.record_event() is s
    finally:
        cpu_mode.disable()
    assert torch.cuda.Stream is not cpu_mode._NoStream
