"""Adapters: nanotune's PEFT-format files load in PEFT (and PEFT's load here), load_adapter
round-trips, and merged folders load in transformers with the adapted model's logits."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import NAMED_MODELS, LoRAConfig, load_model
from model.adapters import (
    adapter_quantization,
    load_adapter,
    load_with_adapter,
    merge_and_save,
    read_adapter_config,
    save_adapter,
)
from model.lora import lora_parameters, quantization
from tests.helpers import ROOT, randomize_lora_b, refusal_here, rel_err, run_script
from tests.tiny_models import FAMILIES, make_run_folder, save_tiny
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
    _edit_config(adapter, fan_in_fan_out=True)
    with pytest.raises(ValueError, match="fan_in_fan_out=True is a PEFT option nanotune does not implement"):
        read_adapter_config(adapter)
    _edit_config(adapter, fan_in_fan_out=False, init_lora_weights="pissa_niter_4")
    with pytest.raises(ValueError, match="init_lora_weights='pissa_niter_4'.*path_initial_model_for_weight_conversion"):
        read_adapter_config(adapter)
    _edit_config(adapter, init_lora_weights=True, target_modules="all-linear")
    with pytest.raises(ValueError, match="target_modules='all-linear'"):
        read_adapter_config(adapter)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path))


def test_save_or_merge_without_what_it_needs(llama_adapter, tmp_path):
    folder, _ = llama_adapter
    base, _ = load_model(folder)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(base, str(tmp_path / "a"))
    save_tiny("gemma2", str(tmp_path / "g2"))
    gemma2, _ = load_model(str(tmp_path / "g2"))
    del gemma2.hf_config  # as if it came from a file without a config.json
    gemma2.config.rope_local_theta = 5.0  # a number no Gemma 2 config.json can hold
    with pytest.raises(ValueError, match="cannot write this Gemma2ForCausalLM config as config.json: it would "
                                         "read back with {'rope_local_theta': None}"):
        merge_and_save(gemma2, None, str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()



# ----------------------------------------------------------------------------- adapters that travel

def test_auto_peft_model_finds_the_base(tmp_path, monkeypatch):
    """A base named by a relative path is recorded as an absolute one, so PEFT's
    AutoPeftModelForCausalLM loads base and adapter from the adapter folder alone, from anywhere."""
    from peft import AutoPeftModelForCausalLM
    save_tiny("qwen2", str(tmp_path / "base"))
    monkeypatch.chdir(tmp_path)
    model, _ = load_model("base", lora=LoRAConfig(r=4, alpha=8.0))
    randomize_lora_b(model, std=0.1)
    save_adapter(model, "adapter", base_model="base")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(tmp_path / "base")
    monkeypatch.chdir(ROOT)
    peft = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32).eval()
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(model(ids), peft(input_ids=ids).logits) < 1e-4


def test_adapter_records_its_base_and_card(llama_folder, tmp_path):
    """A short name is recorded as its hub repo id; the quantization in nanotune.json (PEFT's
    config stays free of keys it would warn about); the model card as the hub reads it."""
    import warnings

    from huggingface_hub import ModelCard
    from peft import PeftConfig
    model, _ = load_model(llama_folder, lora=LoRAConfig(r=4), quantize="nf4")
    out = tmp_path / "adapter"
    save_adapter(model, str(out), base_model="tinyllama", dataset="data/tasks.jsonl",
                 options={"lr": 3e-4, "max_steps": 60}, metrics={"eval_loss": 1.2345, "eval_accuracy": 0.5})
    repo = NAMED_MODELS["tinyllama"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peft_config = PeftConfig.from_pretrained(str(out))
    assert peft_config.base_model_name_or_path == repo and peft_config.r == 4
    assert adapter_quantization(str(out)) == "nf4"
    card = ModelCard.load(str(out / "README.md"))
    assert card.data.base_model == repo and card.data.library_name == "peft"
    assert f"base_model:adapter:{repo}" in card.data.tags and "lora" in card.data.tags
    for text in ("data/tasks.jsonl", "| lr | 0.0003 |", "| max_steps | 60 |", "| eval_loss | 1.234 |",
                 "4-bit NF4", "AutoPeftModelForCausalLM"):
        assert text in card.text, text
    full, _ = load_model(llama_folder, lora=LoRAConfig(r=4))
    save_adapter(full, str(tmp_path / "full"))
    assert adapter_quantization(str(tmp_path / "full")) is None
    assert ModelCard.load(str(tmp_path / "full" / "README.md")).data.base_model is None


def test_save_adapter_is_atomic(llama_adapter, monkeypatch, tmp_path):
    """A write that fails leaves the previous adapter whole and no temporary folder; a folder that
    holds something else is refused, untouched."""
    import model.adapters
    folder, adapter = llama_adapter
    before = {f: open(os.path.join(adapter, f), "rb").read() for f in os.listdir(adapter)}
    model_, _ = load_model(folder, lora=LoRAConfig(r=4))
    randomize_lora_b(model_)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(model.adapters, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(model_, adapter)
    assert {f: open(os.path.join(adapter, f), "rb").read() for f in os.listdir(adapter)} == before
    assert sorted(os.listdir(os.path.dirname(adapter))) == ["adapter", "base"]
    monkeypatch.undo()
    save_adapter(model_, adapter)  # replaces the earlier adapter
    assert open(os.path.join(adapter, "adapter_model.safetensors"), "rb").read() != \
        before["adapter_model.safetensors"]
    with pytest.raises(ValueError, match="is not an earlier output of this kind .it has no adapter_config.json"):
        save_adapter(model_, folder)
    assert os.path.isfile(os.path.join(folder, "config.json"))


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """(base folder with a tokenizer, adapter trained on its NF4 weights, that model)."""
    root = tmp_path_factory.mktemp("qlora")
    folder = make_run_folder(str(root / "base"), family="tinyllama")
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0), quantize="nf4")
    randomize_lora_b(model, std=0.1)
    save_adapter(model, str(root / "adapter"), base_model=folder)
    return folder, str(root / "adapter"), model


def test_load_with_adapter_uses_the_trained_base(qlora_run):
    """An adapter trained on NF4 weights is applied to those weights unless the full base is asked for."""
    folder, adapter, trained = qlora_run
    as_trained, _ = load_with_adapter(folder, adapter)
    full, _ = load_with_adapter(folder, adapter, base_precision="full")
    assert quantization(as_trained) == "nf4" and quantization(full) is None
    ids = ids_for(trained)
    with torch.no_grad():
        expected = trained(ids)
        assert torch.equal(as_trained(ids), expected)
        assert rel_err(full(ids), expected) > 1e-3
    with pytest.raises(ValueError, match="base_precision must be one of"):
        load_with_adapter(folder, adapter, base_precision="nf4")


def test_merge_script_writes_what_transformers_loads(qlora_run, tmp_path, monkeypatch, capsys):
    """scripts/merge.py on a QLoRA adapter: transformers loads the folder (weights, config, tokenizer,
    chat template) to the logits of nanotune's model as it was trained (NF4 base, dequantized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, adapter, trained = qlora_run
    out = tmp_path / "merged"
    r = run_script("merge.py", "--model", folder, "--adapter", adapter, "--out", out, "--dtype", "fp32")
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {out}", r.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = ids_for(trained)
    with torch.no_grad():
        assert rel_err(merged(ids).logits, trained(ids)) < 1e-5
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and tok.encode("Hello there", add_special_tokens=False) == \
        AutoTokenizer.from_pretrained(folder).encode("Hello there", add_special_tokens=False)
    assert "merged into | dequantized NF4" in (out / "README.md").read_text()
    # refused before any loading
    r = refusal_here(monkeypatch, capsys, "merge.py", "--model", folder, "--adapter", adapter, "--out", out)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {str(out)!r} exists and is not empty"), r.stderr
