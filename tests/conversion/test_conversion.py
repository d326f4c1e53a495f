"""HF GPT-2 / Llama <-> megatron-core conversion, proven on real models (CPU, gloo, torchrun).

Odd sizes on purpose: 6 heads, vocab 1000 / 1100 (not multiples of 128), GQA (6 heads, 2 KV
groups) and an untied head for Llama, every parameter (norms included) randomised so a
swapped or mis-ordered tensor cannot hide behind ones/zeros.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")

V_GPT2, V_LLAMA = 1000, 1100


def _randomise(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    gpt2 = _randomise(GPT2LMHeadModel(GPT2Config(
        n_embd=48, n_layer=4, n_head=6, vocab_size=V_GPT2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), 1)
    llama = _randomise(LlamaForCausalLM(LlamaConfig(
        hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, intermediate_size=88,
        vocab_size=V_LLAMA, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5000.0,
        bos_token_id=1, eos_token_id=2)), 2)
    gpt2.save_pretrained(root / "gpt2")
    llama.save_pretrained(root / "llama")
    return {"gpt2": (root / "gpt2", gpt2), "llama": (root / "llama", llama)}


@pytest.fixture(scope="module")
def tp2pp2(hf_models, tmp_path_factory):
    """Both models converted straight to TP=2/PP=2 checkpoints."""
    from workbench.conversion import hf_to_megatron

    root = tmp_path_factory.mktemp("mc")
    return {name: hf_to_megatron(d, root / name, tp=2, pp=2, device="cpu", progress=False)
            for name, (d, _) in hf_models.items()}


def _tp2pp2_tokens(hf):
    return torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def _vpp_tokens():
    return torch.randint(0, V_GPT2, (1, 10), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def forwards(hf_models, tp2pp2):
    """The converted checkpoints' logits from one launch of four ranks (``tests.support.verify_runs``: verify's
    worker once per job): each model at TP=2/PP=2, and the GPT-2 one at TP=1/PP=2/VPP=2 (its other two ranks
    data-parallel replicas)."""
    from tests.support.verify_runs import forward_logits_many

    names = list(hf_models)
    got = forward_logits_many([dict(ckpt=tp2pp2[n].output, tokens=_tp2pp2_tokens(hf_models[n][1]), tp=2, pp=2) for n in names]
                              + [dict(ckpt=tp2pp2["gpt2"].output, tokens=_vpp_tokens(), tp=1, pp=2, vpp=2)])
    return {**dict(zip(names, got)), "gpt2-vpp": got[-1]}


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


# --------------------------------------------------------------------------- pure mapping (no megatron)


def test_llama_qkv_gqa_and_swiglu_layout(hf_models):
    """mcore's fused QKV is per query group [q heads of the group, k_g, v_g]; fc1 is [gate; up]."""
    from workbench.conversion.hf import hf_to_mcore, mcore_to_hf, run_config_from_hf

    _, llama = hf_models["llama"]
    cfg = run_config_from_hf(llama.config.to_dict())
    a, g, d, h = 6, 2, 8, 48
    sd = {k: v.clone() for k, v in llama.state_dict().items()}
    # label every row: q rows with their head, k/v rows with 100/200 + group
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.arange(a).repeat_interleave(d)[:, None].float().expand(-1, h).clone()
    sd["model.layers.0.self_attn.k_proj.weight"] = (100 + torch.arange(g).repeat_interleave(d))[:, None].float().expand(-1, h).clone()
    sd["model.layers.0.self_attn.v_proj.weight"] = (200 + torch.arange(g).repeat_interleave(d))[:, None].float().expand(-1, h).clone()
    out = hf_to_mcore(sd, cfg, "llama")
    rows = out["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    expected = []
    for grp in range(g):
        for head in range(grp * a // g, (grp + 1) * a // g):
            expected += [head] * d
        expected += [100 + grp] * d + [200 + grp] * d
    assert rows == expected
    fc1 = out["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:88], sd["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[88:], sd["model.layers.1.mlp.up_proj.weight"])
    # vocab padded to derive()'s size (1100 -> 1152 at tp=1) with mean rows; untied head kept separately
    emb = out["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 1152 and out["output_layer.weight"].shape[0] == 1152
    assert torch.allclose(emb[1100:], sd["model.embed_tokens.weight"].mean(0, keepdim=True).expand(52, -1))
    back = mcore_to_hf(out, cfg, "llama")
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_gpt2_conv1d_qkv_is_regrouped_per_head(hf_models):
    from workbench.conversion.hf import hf_to_mcore, run_config_from_hf

    _, gpt2 = hf_models["gpt2"]
    cfg = run_config_from_hf(gpt2.config.to_dict())
    assert cfg.model.gelu_approximate == "tanh" and cfg.model.tie_embeddings
    sd = gpt2.state_dict()
    out = hf_to_mcore(sd, cfg, "gpt2")
    w = sd["transformer.h.2.attn.c_attn.weight"]  # Conv1D: [in, 3*out] = [h, q|k|v]
    qkv = out["decoder.layers.2.self_attention.linear_qkv.weight"]  # [heads*3*d, h]
    for head in range(6):
        for j, part in enumerate("qkv"):
            hf_rows = w[:, j * 48 + head * 8: j * 48 + (head + 1) * 8].t()
            assert torch.equal(qkv[head * 24 + j * 8: head * 24 + (j + 1) * 8], hf_rows), (head, part)
    assert "output_layer.weight" not in out  # tied


def test_pytorch_bin_checkpoints_load_with_weights_only(hf_models, tmp_path):
    """Non-safetensors HF dirs (pytorch_model.bin) are read with torch.load(weights_only=True)."""
    from workbench.conversion.hf import load_hf_state_dict
    from workbench.models.common.conversion_rules import ConversionError

    _, gpt2 = hf_models["gpt2"]
    (tmp_path / "bin").mkdir()
    gpt2.config.save_pretrained(tmp_path / "bin")
    torch.save(gpt2.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # the pre-safetensors layout
    sd = load_hf_state_dict(tmp_path / "bin")
    ref = gpt2.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in sd) and "transformer.wte.weight" in sd
    torch.save({"w": _Evil()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="weights_only"):
        load_hf_state_dict(tmp_path / "bin")


def test_architecture_refusals():
    from workbench.config import ModelConfig
    from workbench.conversion.hf import infer_model_type, run_config_from_hf
    from workbench.models.common.conversion_rules import ConversionError

    with pytest.raises(ConversionError, match="neither HF GPT-2"):
        infer_model_type(ModelConfig(position_embedding="rope", normalization="layernorm"))
    with pytest.raises(ConversionError, match="RoPE scaling"):
        run_config_from_hf({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                            "intermediate_size": 8, "vocab_size": 10, "max_position_embeddings": 8,
                            "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    with pytest.raises(ConversionError, match="activation_function"):
        run_config_from_hf({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1, "vocab_size": 10,
                            "n_positions": 8, "activation_function": "relu"})


# --------------------------------------------------------------------------- the proof at TP=2 / PP=2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tp2_pp2_logits_match_hf_and_export_is_bit_identical(name, hf_models, tp2pp2, forwards, tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.checkpoint import read_metadata
    from workbench.conversion import megatron_to_hf

    hf_dir, hf = hf_models[name]
    res = tp2pp2[name]
    meta = read_metadata(res.output)
    assert meta["config"]["parallel"]["tensor_parallel"] == 2 and meta["config"]["parallel"]["pipeline_parallel"] == 2
    assert json.loads(res.config_path.read_text())["checkpoint"]["load_dir"] == str(res.output)

    tokens = _tp2pp2_tokens(hf)
    got = forwards[name]  # 4 torchrun ranks on CPU
    V = hf.config.vocab_size
    assert got.shape[-1] == -(-V // 256) * 256  # padded for tp=2: a multiple of 128*2 (1024 / 1280)
    ref = _hf_logits(hf, tokens)
    assert ref.abs().max() > 0.5  # logits are not trivially small
    assert (got[..., :V] - ref).abs().max() < 1e-4

    out = tmp_path / "back"
    back = megatron_to_hf(res.output, out, max_shard_size="60KB", progress=False)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    assert not list(tmp_path.glob("back.tmp-*"))
    assert back.output == out.resolve()
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(reloaded).__name__ == type(hf).__name__
    a, b = hf.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert reloaded.config.vocab_size == V  # pad rows never reach HF


@pytest.mark.slow
def test_vpp_chunks_keep_layer_order(hf_models, forwards):
    """The TP=2/PP=2 checkpoint loads at TP=1/PP=2/VPP=2 (interleaved chunks) and still gives HF's logits."""
    _, hf = hf_models["gpt2"]
    tokens = _vpp_tokens()
    got = forwards["gpt2-vpp"]
    assert (got[..., :V_GPT2] - _hf_logits(hf, tokens)).abs().max() < 1e-4


def test_reshape_matches_direct_conversion(hf_models, tp2pp2, tmp_path):
    """TP=2/PP=2 -> reshape -> TP=1/PP=1 equals converting at TP=1/PP=1 directly (vocab re-padded 1280 -> 1152)."""
    from workbench.checkpoint import read_metadata
    from workbench.config import ConfigError
    from workbench.conversion import hf_to_megatron, reshape
    from workbench.conversion.runtime import load_full_state_dict
    from workbench.models.common.one_process import single_process_group

    hf_dir, _ = hf_models["llama"]
    res = reshape(tp2pp2["llama"].output, tmp_path / "tp1", tp=1, pp=1)
    cfg = res.config
    assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel) == (1, 1)
    assert read_metadata(res.output)["config"]["parallel"]["tensor_parallel"] == 1
    direct = hf_to_megatron(hf_dir, tmp_path / "direct", tp=1, pp=1, device="cpu", progress=False)
    with single_process_group():
        a, _ = load_full_state_dict(res.output)  # loads at the new layout
        b, _ = load_full_state_dict(direct.output)
    assert a["embedding.word_embeddings.weight"].shape[0] == 1152
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    with pytest.raises(ConfigError, match="tensor_parallel"):
        reshape(tp2pp2["llama"].output, tmp_path / "bad", tp=4, pp=1)  # 6 heads, 2 KV groups
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- legacy Megatron-LM


def _write_legacy_from_gpt2(hf, root, tp: int, pp: int, version: float, with_args: bool = True):
    """A Megatron-LM (pre-mcore) GPT checkpoint written from the documented format, not from the importer."""
    sd = hf.state_dict()
    h, a, d, L = 48, 6, 8, 4
    padded = 1024
    wte = torch.cat([sd["transformer.wte.weight"], torch.zeros(padded - V_GPT2, h)])
    it = root / "iter_0000050"
    for s in range(pp):
        for t in range(tp):
            enc = {}
            for i in range(s * L // pp, (s + 1) * L // pp):
                p, li = f"transformer.h.{i}.", i - s * L // pp
                w = sd[p + "attn.c_attn.weight"].t()  # [3h, h] = q|k|v
                b = sd[p + "attn.c_attn.bias"]
                if version >= 2.0:  # per head [q, k, v]
                    w = w.reshape(3, a, d, h).transpose(0, 1).reshape(3 * h, h)
                    b = b.reshape(3, a, d).transpose(0, 1).reshape(3 * h)
                    wq, bq = w.chunk(tp, 0)[t], b.chunk(tp, 0)[t]
                else:
                    assert tp == 1
                    wq, bq = w, b
                enc.update({
                    f"layers.{li}.input_layernorm.weight": sd[p + "ln_1.weight"], f"layers.{li}.input_layernorm.bias": sd[p + "ln_1.bias"],
                    f"layers.{li}.attention.query_key_value.weight": wq.clone(), f"layers.{li}.attention.query_key_value.bias": bq.clone(),
                    f"layers.{li}.attention.dense.weight": sd[p + "attn.c_proj.weight"].t().chunk(tp, 1)[t].clone(),
                    f"layers.{li}.attention.dense.bias": sd[p + "attn.c_proj.bias"],
                    f"layers.{li}.post_attention_layernorm.weight": sd[p + "ln_2.weight"],
                    f"layers.{li}.post_attention_layernorm.bias": sd[p + "ln_2.bias"],
                    f"layers.{li}.mlp.dense_h_to_4h.weight": sd[p + "mlp.c_fc.weight"].t().chunk(tp, 0)[t].clone(),
                    f"layers.{li}.mlp.dense_h_to_4h.bias": sd[p + "mlp.c_fc.bias"].chunk(tp, 0)[t].clone(),
                    f"layers.{li}.mlp.dense_4h_to_h.weight": sd[p + "mlp.c_proj.weight"].t().chunk(tp, 1)[t].clone(),
                    f"layers.{li}.mlp.dense_4h_to_h.bias": sd[p + "mlp.c_proj.bias"],
                })
            lm = {"encoder": enc}
            if s == 0:
                lm["embedding"] = {"word_embeddings": {"weight": wte.chunk(tp, 0)[t].clone()},
                                   "position_embeddings": {"weight": sd["transformer.wpe.weight"]}}
            if s == pp - 1:
                enc["final_layernorm.weight"] = sd["transformer.ln_f.weight"]
                enc["final_layernorm.bias"] = sd["transformer.ln_f.bias"]
                if pp > 1:
                    lm["word_embeddings_for_head"] = {"weight": wte.chunk(tp, 0)[t].clone()}
            ck = {"model": {"language_model": lm}, "checkpoint_version": version, "iteration": 50}
            if with_args:
                ck["args"] = argparse.Namespace(num_layers=L, hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h,
                                                max_position_embeddings=64, seq_length=64, padded_vocab_size=padded,
                                                layernorm_epsilon=1e-5, bias_gelu_fusion=True, tensor_model_parallel_size=tp)
            name = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "")
            (it / name).mkdir(parents=True)
            torch.save(ck, it / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("50")
    return root


def test_legacy_import_merges_tp_shards_and_pp_stages(hf_models, tmp_path):
    from workbench.conversion import hf_to_megatron, import_legacy
    from workbench.conversion.runtime import load_full_state_dict
    from workbench.models.common.one_process import single_process_group

    hf_dir, gpt2 = hf_models["gpt2"]
    direct = hf_to_megatron(hf_dir, tmp_path / "direct", tp=1, pp=1, device="cpu", progress=False)
    v3 = import_legacy(_write_legacy_from_gpt2(gpt2, tmp_path / "legacy-v3", tp=2, pp=2, version=3.0),
                       tmp_path / "from-v3", vocab_size=V_GPT2)
    v0 = import_legacy(_write_legacy_from_gpt2(gpt2, tmp_path / "legacy-v0", tp=1, pp=1, version=0.0, with_args=False),
                       tmp_path / "from-v0", vocab_size=V_GPT2, num_attention_heads=6)
    assert v3.config.model.gelu_approximate == "tanh" and v3.config.model.num_layers == 4
    with single_process_group():
        ref, _ = load_full_state_dict(direct.output)
        for res in (v3, v0):
            got, meta = load_full_state_dict(res.output)
            assert meta["extra"]["source"]["format"] == "megatron-lm-legacy"
            assert got.keys() == ref.keys()
            for k in ref:
                assert torch.equal(got[k], ref[k]), (res.output.name, k)


def test_legacy_refuses_unsafe_pickles(tmp_path):
    from workbench.conversion import import_legacy
    from workbench.models.common.conversion_rules import ConversionError

    d = tmp_path / "evil" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": {"language_model": {}}, "args": _Evil()}, d / "model_optim_rng.pt")
    with pytest.raises(ConversionError, match="weights_only"):
        import_legacy(tmp_path / "evil", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Evil:
    """Stands in for any non-allowlisted pickled object."""


# --------------------------------------------------------------------------- refusals and CLI


def test_hf_to_megatron_refuses_before_writing(hf_models, tmp_path):
    from workbench.config import ConfigError
    from workbench.conversion import hf_to_megatron
    from workbench.models.common.conversion_rules import ConversionError

    hf_dir, _ = hf_models["gpt2"]
    with pytest.raises(ConfigError, match="num_attention_heads 6 is not divisible by tensor_parallel 4"):
        hf_to_megatron(hf_dir, tmp_path / "x", tp=4, pp=1)
    with pytest.raises(ConfigError, match="num_layers 4 is fewer than pipeline_parallel 5 stages"):
        hf_to_megatron(hf_dir, tmp_path / "x", tp=1, pp=5)
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        hf_to_megatron(hf_dir, tmp_path / "full")
    other = tmp_path / "neox"  # an HF architecture no family converts (HF "bert" is refused by the BERT family's own rule)
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ConversionError, match="model_type 'gpt_neox' is not supported"):
        hf_to_megatron(other, tmp_path / "y")


def test_cli(hf_models, tp2pp2, tmp_path, capsys):
    from workbench.cli import main

    hf_dir, _ = hf_models["gpt2"]
    assert main(["convert", "hf-to-megatron", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert main(["convert", "megatron-to-hf", "--ckpt", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err

    assert main(["convert", "inspect", str(tp2pp2["llama"].output)]) == 0
    out = capsys.readouterr().out
    assert "decoder.layers.self_attention.linear_qkv.weight" in out and "[4, 80, 48]" in out  # 4 layers x (6+2*2)*8 rows
    assert "decoder.layers.mlp.linear_fc1.weight" in out and "[4, 176, 48]" in out  # [gate; up] = 2 x 88
    assert main(["convert", "hf-to-megatron", "--hf", str(hf_dir), "--out", str(tmp_path / "ok"), "--quiet",
                 "--print-checkpoint-structure", "--dtype", "bf16", "--make-vocab-size-divisible-by", "64"]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0.attn.c_attn.weight" in out  # the HF side
    assert "embedding.word_embeddings.weight" in out and "[1024, 48]" in out and "bfloat16" in out
    cfg = json.loads((tmp_path / "ok" / "workbench_config.json").read_text())
    assert cfg["train"]["precision"] == "bf16" and cfg["model"]["make_vocab_size_divisible_by"] == 64


def test_tokenizer_files_travel_with_the_checkpoint(hf_models, tmp_path):
    """HF dir with a tokenizer -> checkpoint (tokenizer/ copy, data.tokenizer set) -> HF export that AutoTokenizer loads."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from workbench.checkpoint import read_metadata
    from workbench.conversion import hf_to_megatron, megatron_to_hf

    src, _ = hf_models["gpt2"]
    hf_dir = tmp_path / "with-tok"
    shutil.copytree(src, hf_dir)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V_GPT2 - 1)} | {"<unk>": V_GPT2 - 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(hf_dir)

    res = hf_to_megatron(hf_dir, tmp_path / "mc", device="cpu", progress=False)
    assert (res.output / "tokenizer" / "tokenizer.json").is_file()
    assert res.config.data.tokenizer == str(res.output / "tokenizer")
    assert read_metadata(res.output)["tokenizer"] == str(res.output / "tokenizer")
    megatron_to_hf(res.output, tmp_path / "back", progress=False)
    back = AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert back("w5 w17 zz")["input_ids"] == [5, 17, V_GPT2 - 1]


@pytest.mark.slow
def test_backend_continues_training_from_a_converted_checkpoint(tmp_path):
    """The GPU proof's script on CPU (fp32, PP=2 with tied embeddings): the real backend (torchrun +
    ``python -m workbench.rank``) fine-tunes the converted GPT-2; step 1's loss is HF's loss on the same batches."""
    from tests.gpu_proofs.conversion_continue_training import main

    out = tmp_path / "evidence.jsonl"
    rc = main(["--device", "cpu", "--tp", "1", "--pp", "2", "--steps", "2", "--work", str(tmp_path / "w"), "--out", str(out)])
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rc == 0 and rec["ok"], rec
    assert rec["backend_exit_code"] == 0 and len(rec["backend_losses"]) == 2 and rec["microbatches_recorded"] == 2
    assert abs(rec["backend_losses"][0] - rec["hf_loss_fp32"]) < 1e-4  # fp32: tighter than the GPU's bf16 tolerance
    assert rec["backend_losses"][1] < rec["backend_losses"][0]  # and it trains
