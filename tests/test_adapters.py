"""Adapters: nanotune's PEFT-format files load in PEFT (and PEFT's load here), load_adapter
round-trips, and merged folders load in transformers with the adapted model's logits."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import LoRAConfig, load_model
from model.adapters import load_adapter, merge_and_save, read_adapter_config, save_adapter
from model.lora import lora_parameters
from tests.helpers import randomize_lora_b, rel_err
from tests.tiny_models import FAMILIES, save_tiny
from tests.tiny_tokenizer import make_test_tokenizer

B, T = 2, 20
TARGETS = {"llama": ("q_proj", "v_proj", "gate_proj", "down_proj")}  # the others: all seven


def hf_from(folder):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def adapted(request, tmp_path_factory):
    """(family, base folder, nanotune model with random LoRA weights, its saved adapter folder)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder = str(root / "base")
    save_tiny(family, folder)
    kw = {"targets": TARGETS[family]} if family in TARGETS else {}
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, rslora=family == "gemma", **kw))
    randomize_lora_b(model, std=0.1)
    save_adapter(model, str(root / "adapter"), base_model=folder)
    return family, folder, model, str(root / "adapter")


def ids_for(model):
    return torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def test_peft_loads_our_adapter(adapted):
    from peft import PeftModel
    family, folder, model, adapter = adapted
    peft = PeftModel.from_pretrained(hf_from(folder), adapter).eval()
    ids = ids_for(model)
    with torch.no_grad():
        err = rel_err(model(ids), peft(input_ids=ids).logits)
    assert err < 1e-4, f"{family}: nanotune vs PEFT-loaded adapter, logits rel err {err:.2e}"


def test_load_adapter_round_trip(adapted):
    family, folder, model, adapter = adapted
    fresh, _ = load_model(folder, lora=read_adapter_config(adapter), lora_seed=7)
    load_adapter(fresh, adapter)
    for (n, p), (_, q) in zip(lora_parameters(model), lora_parameters(fresh)):
        assert torch.equal(p, q), n
    ids = ids_for(model)
    with torch.no_grad():
        assert torch.equal(model(ids), fresh(ids))


def test_merged_folder_loads_in_transformers(adapted, tmp_path):
    family, folder, model, adapter = adapted
    tok = make_test_tokenizer(tmp_path / "tok")
    out = str(tmp_path / "merged")
    shard = 40_000 if family == "llama" else 2 << 30  # llama: several shards and an index
    merge_and_save(model, tok, out, max_shard_bytes=shard)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) == (family == "llama")
    ids = ids_for(model)
    with torch.no_grad():
        err = rel_err(hf_from(out)(ids).logits, model(ids))
    assert err < 1e-4, f"{family}: merged model vs adapted model, logits rel err {err:.2e}"


def test_peft_adapter_loads_here(tmp_path):
    """An adapter PEFT trained and saved (qwen2: qkv bias, tied embeddings) loads into nanotune."""
    from peft import LoraConfig, get_peft_model
    folder = str(tmp_path / "base")
    hf = save_tiny("qwen2", folder)
    peft = get_peft_model(hf, LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "o_proj", "up_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    peft.save_pretrained(str(tmp_path / "adapter"))
    model, _ = load_model(folder, lora=read_adapter_config(str(tmp_path / "adapter")))
    load_adapter(model, str(tmp_path / "adapter"))
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(model(ids), peft.eval()(input_ids=ids).logits) < 1e-4


def test_merge_nf4_model(tmp_path):
    folder = str(tmp_path / "base")
    save_tiny("llama", folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=4), quantize="nf4")
    randomize_lora_b(model, std=0.1)
    merge_and_save(model, None, str(tmp_path / "merged"))
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(hf_from(str(tmp_path / "merged"))(ids).logits, model(ids)) < 1e-4


# ----------------------------------------------------------------------------- errors

@pytest.fixture
def llama_adapter(tmp_path):
    folder = str(tmp_path / "base")
    save_tiny("llama", folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=4))
    save_adapter(model, str(tmp_path / "adapter"))
    return folder, str(tmp_path / "adapter")


def _edit_config(adapter, **changes):
    path = os.path.join(adapter, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def test_adapter_that_does_not_fit_the_model(llama_adapter):
    folder, adapter = llama_adapter
    other, _ = load_model(folder, lora=LoRAConfig(r=8))
    with pytest.raises(ValueError, match=r"r=4.*built with r=8.*load_model\(\.\.\., lora=read_adapter_config"):
        load_adapter(other, adapter)
    base, _ = load_model(folder)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        load_adapter(base, adapter)


def test_adapter_with_wrong_tensors(llama_adapter):
    folder, adapter = llama_adapter
    model, _ = load_model(folder, lora=LoRAConfig(r=4))
    path = os.path.join(adapter, "adapter_model.safetensors")
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 65)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight has shape \(4, 65\), the model expects \(4, 64\)"):
        load_adapter(model, adapter)
    del tensors[key]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="missing keys.*layers.0.self_attn.q_proj.lora_A"):
        load_adapter(model, adapter)


def test_unsupported_adapter_config(llama_adapter, tmp_path):
    folder, adapter = llama_adapter
    _edit_config(adapter, use_dora=True)
    with pytest.raises(ValueError, match="use_dora=True is a PEFT option nanotune does not implement"):
        read_adapter_config(adapter)
    _edit_config(adapter, use_dora=False, target_modules="all-linear")
    with pytest.raises(ValueError, match="target_modules='all-linear'"):
        read_adapter_config(adapter)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path))


def test_save_or_merge_without_what_it_needs(llama_adapter, tmp_path):
    from model.config import from_hf_config
    from model.transformer import Transformer
    folder, _ = llama_adapter
    base, _ = load_model(folder)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(base, str(tmp_path / "a"))
    with open(os.path.join(folder, "config.json")) as f:
        built = Transformer(from_hf_config(json.load(f)), lora=LoRAConfig(r=2))
    with pytest.raises(ValueError, match="model.hf_config"):
        merge_and_save(built, None, str(tmp_path / "m"))
