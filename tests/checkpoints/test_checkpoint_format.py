"""The workbench checkpoint format: atomic saves, discovery, round trips, refusals (real mcore, 1 CPU rank)."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.config import preset


pytestmark = pytest.mark.filterwarnings("ignore")


def _model(cfg, seed: int):
    from workbench.rank.build import build_model

    torch.manual_seed(seed)
    return build_model(cfg)


def _params(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items() if torch.is_tensor(v)}


def test_save_load_round_trip_and_metadata(dist_group, tmp_path):
    from workbench.checkpoint import FORMAT, find_checkpoint, load_checkpoint, read_metadata, save_checkpoint

    cfg = dist_group
    a, b = _model(cfg, 1), _model(cfg, 2)
    pa, pb = _params(a), _params(b)
    assert any(not torch.equal(pa[k], pb[k]) for k in pa)  # different init, so the load below must do the work
    rng = torch.get_rng_state()
    path = save_checkpoint(tmp_path / "ck", 12, [a], cfg, extra={"consumed_samples": 48, "rng": rng}, tokenizer="demo")
    assert path.name == "iter_0000012"
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert not [p for p in (tmp_path / "ck").iterdir() if ".tmp-" in p.name]
    meta = read_metadata(tmp_path / "ck")
    assert meta["format"] == FORMAT and meta["complete"] is True and meta["iteration"] == 12
    assert meta["config"] == cfg.to_dict() and meta["tokenizer"] == "demo"
    assert find_checkpoint(tmp_path / "ck") == path == find_checkpoint(path)

    got = load_checkpoint(tmp_path / "ck", [b])
    assert got["iteration"] == 12 and got["extra"]["consumed_samples"] == 48
    assert torch.equal(got["extra"]["rng"], rng)
    for k, v in _params(b).items():
        assert torch.equal(v, pa[k]), k


def test_incomplete_saves_are_never_picked(dist_group, tmp_path):
    import workbench.checkpoint as C

    cfg = dist_group
    root = tmp_path / "ck"
    good = C.save_checkpoint(root, 5, [_model(cfg, 1)], cfg)
    # an interrupted later save: a tmp dir, and one marked incomplete
    (root / "iter_0000010.tmp-123").mkdir()
    bad = root / "iter_0000011"
    bad.mkdir()
    (bad / "workbench.json").write_text(json.dumps({"format": C.FORMAT, "iteration": 11, "complete": False}))
    assert C.find_checkpoint(root) == good
    (root / "latest_checkpointed_iteration.txt").write_text("11")  # tracker pointing at a partial save
    assert C.find_checkpoint(root) == good
    assert C.list_checkpoints(root) == [good]
    with pytest.raises(C.CheckpointError, match="not a complete workbench checkpoint"):
        C.find_checkpoint(bad)
    # a later iteration without workbench.json is no interrupted save (a save renames its directory into place only
    # after writing that file): refused, naming it, never passed over for the older one
    (root / "iter_0000009").mkdir()
    with pytest.raises(C.CheckpointError, match="iter_0000009/workbench.json is missing"):
        C.find_checkpoint(root)


def test_failed_save_keeps_last_good_checkpoint(dist_group, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    import workbench.checkpoint as C

    cfg = dist_group
    root = tmp_path / "ck"
    good = C.save_checkpoint(root, 1, [_model(cfg, 1)], cfg)

    def crash(*a, **k):  # the writer dies mid-save (disk full, node killed...)
        raise OSError("simulated crash during write")

    monkeypatch.setattr(dist_checkpointing, "save", crash)
    with pytest.raises(OSError):
        C.save_checkpoint(root, 2, [_model(cfg, 2)], cfg)
    monkeypatch.undo()
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002").exists()
    assert C.find_checkpoint(root) == good


def test_clear_errors(dist_group, tmp_path):
    import workbench.checkpoint as C

    cfg = dist_group
    with pytest.raises(C.CheckpointError, match="does not exist"):
        C.find_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(C.CheckpointError, match="no complete checkpoint under"):
        C.find_checkpoint(tmp_path / "empty")
    legacy = tmp_path / "legacy" / "mp_rank_00"
    legacy.mkdir(parents=True)
    with pytest.raises(C.CheckpointError, match="convert legacy"):
        C.find_checkpoint(tmp_path / "legacy")

    C.save_checkpoint(tmp_path / "ck", 3, [_model(cfg, 1)], cfg)
    wider = cfg.replace(**{"model.hidden_size": 128})
    with pytest.raises(C.CheckpointError, match="hidden_size: checkpoint 64, model 128"):
        C.load_checkpoint(tmp_path / "ck", [_model(wider, 1)])
    deeper = cfg.replace(**{"model.num_layers": 6})
    with pytest.raises(C.CheckpointError, match="num_layers"):
        C.load_checkpoint(tmp_path / "ck", [_model(deeper, 1)])


def test_vocab_padding_is_repadded_on_load(dist_group, tmp_path):
    """A model padded differently (e.g. another TP size) loads the real rows; new pad rows are zero."""
    import workbench.checkpoint as C
    from workbench.config import derive

    cfg = dist_group.replace(**{"model.vocab_size": 4000, "model.make_vocab_size_divisible_by": 64})
    other = cfg.replace(**{"model.make_vocab_size_divisible_by": 256})
    assert derive(cfg).padded_vocab_size == 4032 and derive(other).padded_vocab_size == 4096
    src = _model(cfg, 1)
    C.save_checkpoint(tmp_path / "ck", 1, [src], cfg)
    dst = _model(other, 2)
    C.load_checkpoint(tmp_path / "ck", [dst])
    w_src = src.embedding.word_embeddings.weight.detach()
    w_dst = dst.embedding.word_embeddings.weight.detach()
    assert torch.equal(w_dst[:4032], w_src)
    assert torch.count_nonzero(w_dst[4032:]) == 0
    assert torch.equal(_params(dst)["decoder.layers.0.mlp.linear_fc1.weight"], _params(src)["decoder.layers.0.mlp.linear_fc1.weight"])


def test_optimizer_state_round_trip(dist_group, tmp_path):
    """mcore optimizer + DDP-wrapped model: Adam moments survive save/load; finetune skips them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import workbench.checkpoint as C
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    cfg = dist_group

    def make(seed):
        torch.manual_seed(seed)
        tc = transformer_config(cfg)
        ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(), module=build_model(cfg, config=tc))
        return ddp, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32), [ddp])

    model, opt = make(1)
    toks = torch.randint(0, 4000, (2, 16))
    pos = torch.arange(16)[None].expand(2, -1)
    model(toks, pos, None, labels=toks).mean().backward()
    for p in model.parameters():
        if p.grad is None and getattr(p, "main_grad", None) is not None:
            p.grad = p.main_grad.float()
    ok, _, _ = opt.step()
    assert ok
    C.save_checkpoint(tmp_path / "ck", 1, [model], cfg, optimizer=opt)
    assert C.read_metadata(tmp_path / "ck")["has_optimizer"] is True

    model2, opt2 = make(2)
    C.load_checkpoint(tmp_path / "ck", [model2], optimizer=opt2)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and len(s1) > 0
    moved = 0
    for k in s1:
        for name, t in s1[k].items():
            if torch.is_tensor(t):
                assert torch.equal(t, s2[k][name]), (k, name)
                moved += int(name == "exp_avg" and bool(t.abs().sum() > 0))
    assert moved > 0
    for k, v in _params(model2).items():
        assert torch.equal(v, _params(model)[k])

    model3, opt3 = make(3)
    C.load_checkpoint(tmp_path / "ck", [model3], optimizer=opt3, load_optimizer=False)
    assert not any(len(v) for v in opt3.state_dict()["state"].values())
