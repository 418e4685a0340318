"""Model parity against transformers (eager attention) for every family, and loader errors."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from model import NAMED_MODELS, CheckpointError, base_model_id, load_model, read_config, resolve
from model.config import from_hf_config
from tests.helpers import rel_err
from tests.tiny_models import FAMILIES, save_tiny

B, T = 2, 20  # T above the Gemma 2/3 test sliding window (8)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    folder = str(tmp_path_factory.mktemp(family))
    hf = save_tiny(family, folder, sharded=(family == "llama"))
    ours, cfg = load_model(folder, dtype=torch.float32)
    return family, hf, ours, cfg


def test_logits_match_transformers(pair):
    family, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert out.shape == (B, T, cfg.vocab_size)
    err = rel_err(out, ref)
    print(f"{family}: logits rel err {err:.2e}")
    assert err < 1e-4, f"{family}: logits differ from transformers, rel err {err:.2e}"


def test_gradients_match_transformers(pair):
    family, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    labels = torch.randint(0, cfg.vocab_size, (B, T))
    for p in ours.parameters():
        p.requires_grad_(True)
    hf.zero_grad()
    F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(ours(ids).flatten(0, 1), labels.flatten()).backward()
    hf_grads = dict(hf.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        ref = hf_grads[n].grad
        assert p.grad is not None, n
        err = rel_err(p.grad, ref)
        worst = max(worst, err)
        assert err < 1e-4, f"{family}: grad of {n} rel err {err:.2e}"
    print(f"{family}: worst grad rel err {worst:.2e}")
    for p in ours.parameters():
        p.grad = None
        p.requires_grad_(False)


def test_loss_path_matches_logits_path(pair):
    """forward(targets=...) (fused loss, no logits) equals CE over the returned logits."""
    family, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    targets[0, :5] = -100
    with torch.no_grad():
        ref = F.cross_entropy(ours(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss = ours(ids, targets=targets)
    assert rel_err(loss, ref) < 1e-5


def test_packed_documents_match_separate_runs(pair):
    """Two documents packed in one row with restarting position_ids give each document's own logits."""
    family, hf, ours, cfg = pair
    a, b = torch.randint(0, cfg.vocab_size, (1, 13)), torch.randint(0, cfg.vocab_size, (1, 11))
    row = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(13), torch.arange(11)])[None]
    doc = torch.cat([torch.zeros(13), torch.ones(11)]).long()[None]
    with torch.no_grad():
        packed = ours(row, position_ids=pos, doc_ids=doc)
        sep = torch.cat([ours(a), ours(b)], dim=1)
    assert rel_err(packed, sep) < 1e-5


def test_old_style_config_keys():
    """config.json files on the hub use transformers<5 keys (rope_theta, rope_scaling, ...)."""
    llama3 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10,
              "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
              "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    c = from_hf_config(llama3)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and c.head_dim == 16
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 10,
              "head_dim": 32, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
              "sliding_window_pattern": 6, "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh"}
    c = from_hf_config(gemma3)
    assert c.layer_types == ["sliding"] * 5 + ["full"] and c.rope_local_theta == 10000.0
    assert c.qk_norm and c.sandwich_norm and c.norm_offset == 1.0 and c.act == "gelu_tanh"
    gemma2 = {**gemma3, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0}
    del gemma2["sliding_window_pattern"]
    c = from_hf_config(gemma2)
    assert c.layer_types[:2] == ["sliding", "full"] and c.attn_softcap == 50.0 and not c.qk_norm


# ----------------------------------------------------------------------------- errors

def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="Known short names: .*tinyllama"):
        load_model("no-such-model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    save_tiny("llama", str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def _rewrite(folder, fn):
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    save_tiny("llama", str(tmp_path))
    _rewrite(str(tmp_path), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


def test_unexpected_tensor_is_named(tmp_path):
    save_tiny("llama", str(tmp_path))
    _rewrite(str(tmp_path), lambda t: t.update({"model.layers.0.extra.weight": torch.randn(3)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        load_model(str(tmp_path))


def test_shape_mismatch_is_named(tmp_path):
    save_tiny("llama", str(tmp_path))
    _rewrite(str(tmp_path), lambda t: t.update({"model.norm.weight": torch.randn(65)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has shape \\(65,\\), expected \\(64,\\)"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    save_tiny("llama", str(tmp_path))
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(str(tmp_path))


def test_offline_hub_id_says_how_to_use_a_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="pass a local folder"):
        load_model("someone/not-cached-model")


@pytest.mark.parametrize("error, says", [("RepositoryNotFoundError", "no such repository"),
                                         ("HfHubHTTPError", "answered with an error")])
def test_hub_errors_say_what_to_do(monkeypatch, error, says):
    import huggingface_hub
    import huggingface_hub.errors
    cls = getattr(huggingface_hub.errors, error)

    def refuse(repo, **kw):
        e = cls.__new__(cls)  # these errors want an HTTP response to be built; the message is what matters
        Exception.__init__(e, f"404 Client Error for url https://huggingface.co/api/models/{repo}")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ValueError, match=says) as info:
        load_model("someone/no-such-model")
    assert "'someone/no-such-model'" in str(info.value) and "--model /path/to/folder" in str(info.value)


def test_config_json_errors_name_the_file(tmp_path):
    save_tiny("llama", str(tmp_path))
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    del hf["hidden_size"]
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{path} has no 'hidden_size'") as info:
        load_model(str(tmp_path))
    assert "\n" not in str(info.value)
    path.write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        read_config(str(tmp_path))


def test_quantize_is_checked_first():
    """A quantize value other than None / 'nf4' is refused before the model is looked up."""
    with pytest.raises(ValueError, match="quantize must be None or 'nf4'.*'nf8'"):
        load_model("no-such-model", quantize="nf8")


def test_resolve_read_config_and_base_model_id(monkeypatch, tmp_path):
    """Short names and hub ids resolve through the hub (here a fake one), local folders and .gguf
    paths to themselves; base_model_id gives what a hub user or PEFT can load the base by."""
    import huggingface_hub
    repo = NAMED_MODELS["tinyllama"]
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abc"
    save_tiny("llama", str(snapshot))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda r, **kw: str(snapshot) if r == repo else 1 / 0)
    assert resolve("tinyllama") == resolve(repo) == str(snapshot)
    assert read_config("tinyllama") == read_config(str(snapshot)) == from_hf_config(
        json.loads((snapshot / "config.json").read_text()))
    assert base_model_id("tinyllama") == base_model_id(repo) == base_model_id(resolve("tinyllama")) == repo
    local = tmp_path / "local"
    local.mkdir()
    assert resolve(str(local)) == str(local)
    assert base_model_id(os.path.relpath(local)) == str(local)
    gguf = tmp_path / "m.gguf"
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        resolve(str(gguf))
    gguf.write_bytes(b"")
    assert resolve(str(gguf)) == str(gguf) and base_model_id(str(gguf)) == str(gguf)
    with pytest.raises(ValueError, match="Known short names"):
        base_model_id("no-such-model")


@pytest.mark.parametrize("chunk_bytes", [1 << 28, 4 * 256 * 7], ids=["one-chunk", "7-row-chunks"])
def test_score_matches_full_logits(pair, chunk_bytes):
    """score(): per-token loss and argmax hits equal cross-entropy and argmax over the full logits
    (Gemma 2: with its final softcap), computed a chunk of rows at a time."""
    family, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    targets[0, :5] = -100
    with torch.no_grad():
        logits = ours(ids)
        targets[1, 3:9] = logits[1, 3:9].argmax(-1)  # some hits for sure
        made = []  # the logits score() makes, chunk by chunk
        logits_of = ours.logits
        ours.logits = lambda h: made.append(tuple(h.shape[:-1]) + (cfg.vocab_size,)) or logits_of(h)
        loss, hit = ours.score(ids, None, None, targets, chunk_bytes=chunk_bytes)
        del ours.logits  # the method again
    assert max(rows for rows, _ in made) <= max(1, chunk_bytes // (4 * cfg.vocab_size))
    assert sum(rows for rows, _ in made) == B * T
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none").view(B, T)
    assert loss.dtype == torch.float32 and hit.dtype == torch.bool and loss.shape == hit.shape == (B, T)
    assert rel_err(loss, ref) < 1e-6 and (loss[0, :5] == 0).all()
    assert torch.equal(hit, (logits.argmax(-1) == targets)) and hit[1, 3:9].all() and not hit[0, :5].any()


def test_config_json_written_back(tmp_path):
    """to_hf_config: the inverse of from_hf_config for the families a GGUF holds, and a clear refusal
    for a config that config.json cannot say."""
    from dataclasses import replace

    from model.config import to_hf_config
    for family in ("llama", "qwen2", "gemma"):
        save_tiny(family, str(tmp_path / family))
        cfg = read_config(str(tmp_path / family))
        assert from_hf_config(to_hf_config(cfg)) == cfg, family
    with pytest.raises(ValueError, match="would read back with \\{'o_bias': True\\}"):
        to_hf_config(replace(read_config(str(tmp_path / "llama")), qkv_bias=True))
