"""The compiled layer replaces its submodules' forwards, not what hangs on them: megatron's DDP finishes a
parameter's all-gather in a forward pre-hook of the Linear / norm that owns it (``overlap_param_gather`` with
the distributed optimizer).  Real mcore, one CPU rank, the compiled layer's maths run eagerly."""

from __future__ import annotations

import pytest
import torch

from workbench.config import preset

from tests.support import free_port

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def fast_model():
    from workbench.backend import compiled_layer, cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests
    from workbench.rank.build import build_model

    compiled_layer.allow_on_cpu(True)
    compiled_layer.set_compile(False)
    cfg = preset("tiny", **{"train.compile_kernels": True})
    initialize_for_tests(cfg, port=free_port())
    torch.manual_seed(0)
    try:
        yield cfg, build_model(cfg)
    finally:
        destroy()
        cpu_mode.disable()
        compiled_layer.set_compile(True)
        compiled_layer.allow_on_cpu(False)


def test_the_pre_hooks_of_bypassed_submodules_run_before_the_compiled_layer_reads_their_weights(fast_model):
    cfg, model = fast_model
    layer = model.decoder.layers[0]
    assert layer.fast_path_blocker is None
    qkv = layer.self_attention.linear_qkv
    seen = []

    def finish_gather(module, args):  # what DDP's hook does: the weight's final values arrive here
        seen.append(module)
        with torch.no_grad():
            module.weight.mul_(0.0)

    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
    pos = torch.arange(cfg.model.seq_length).unsqueeze(0)
    calls = layer.fast_calls
    handle = qkv.register_forward_pre_hook(finish_gather)
    try:
        out = model(tokens, pos, None)
    finally:
        handle.remove()
    assert seen == [qkv] and layer.fast_calls == calls + 1  # the compiled path ran, and the hook with it
    # the forward used the hook's values: with q, k, v all zero the first layer's attention adds only its biases
    zeroed = model(tokens, pos, None)
    assert torch.equal(out, zeroed)
