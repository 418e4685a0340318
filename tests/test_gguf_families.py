"""GGUF import and export of Qwen3, Gemma 2 and Gemma 3: files written here the way llama.cpp's
converter writes them (its tensor names, metadata keys and Gemma's stored 1 + w norms) load to the
logits of the safetensors model they were written from and of transformers' own GGUF loader; exports
round-trip; merges of such a base load in transformers."""
import os

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

from model import LoRAConfig, load_model, load_tokenizer, read_config  # noqa: E402
from model.adapters import merge_and_save  # noqa: E402
from model.gguf_export import save_gguf  # noqa: E402
from tests.helpers import randomize_lora_b, rel_err  # noqa: E402
from tests.tiny_tokenizer import make_test_tokenizer  # noqa: E402

SMALL = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256, initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(family):
    """Tiny configs whose every number llama.cpp and transformers' GGUF loader can express: head_dim as
    the real models have it (neither loader reads Qwen3's or Gemma's query_pre_attn_scalar from the
    file), sliding windows shorter than the test text."""
    import transformers as tf
    if family == "qwen3":
        return tf.Qwen3Config(**{**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}, num_hidden_layers=2,
                              head_dim=128, tie_word_embeddings=True)  # transformers' GGUF loader assumes 128
    if family == "gemma2":
        return tf.Gemma2Config(**SMALL, num_hidden_layers=2, head_dim=256, query_pre_attn_scalar=256,
                               sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":  # 6 layers: five sliding, one global, with their two rope bases
        return tf.Gemma3TextConfig(**SMALL, num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256,
                                   sliding_window=8, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    raise KeyError(family)


def hf_model(family, seed=0):
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").float().eval()
    with torch.no_grad():  # random init leaves norms at 1 (Gemma: 0); perturb them so they are tested
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# convert_hf_to_gguf's tensor names, written out here independently of model/gguf.py.
LLAMA_CPP_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm"}


def llama_cpp_name(name, family):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    module, _, param = rest.rpartition(".")
    names = {**LLAMA_CPP_NAMES, **(SANDWICH if family.startswith("gemma") else {"post_attention_layernorm":
                                                                                  "ffn_norm"})}
    return f"blk.{i}.{names[module]}.{param}"


def write_like_llama_cpp(model, tok_folder, path, family, skip_keys=()):
    """A GGUF of the transformers `model` laid out as convert_hf_to_gguf writes it (f32)."""
    c = model.config
    w = gguf.GGUFWriter(path, family)
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps}
    if family == "qwen3":
        keys["rope.freq_base"] = c.rope_parameters["rope_theta"]
    if family == "gemma2":
        keys.update({"attention.sliding_window": c.sliding_window, "attn_logit_softcapping":
                     c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping})
    if family == "gemma3":
        keys.update({"attention.sliding_window": c.sliding_window,
                     "rope.freq_base": c.rope_parameters["full_attention"]["rope_theta"]})
    for key, value in keys.items():
        if key in skip_keys:
            continue
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{family}.{key}", value, kind)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tok = load_tokenizer(tok_folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([tok.id_to_token(i) or f"[PAD{i}]" for i in range(c.vocab_size)])
    w.add_token_merges([" ".join(m) for m in __import__("json").loads(tok.tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(1), w.add_eos_token_id(2)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = p.detach().float()
        if family.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # convert_hf_to_gguf stores Gemma's 1 + w
        w.add_tensor(llama_cpp_name(name, family), t.numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


FAMILIES = ["qwen3", "gemma2", "gemma3"]
IDS = torch.randint(3, 400, (2, 30), generator=torch.Generator().manual_seed(0))  # longer than the windows


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (transformers model, its safetensors folder with tokenizer, a llama.cpp-layout GGUF of it)."""
    out = {}

    def get(family):
        if family not in out:
            folder = tmp_path_factory.mktemp(family)
            model = hf_model(family)
            model.save_pretrained(str(folder / "hf"))
            make_test_tokenizer(str(folder / "hf"))
            out[family] = model, str(folder / "hf"), write_like_llama_cpp(model, str(folder / "hf"),
                                                                          str(folder / "m.gguf"), family)
        return out[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_the_source_and_transformers_gguf_loader(family, made):
    from transformers import AutoModelForCausalLM
    ref, _, path = made(family)
    ours, cfg = load_model(path)
    assert read_config(path) == cfg
    folder, name = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    with torch.no_grad():
        got, want, loader = ours(IDS), ref(IDS).logits, theirs(IDS).logits
    assert rel_err(got, want) < 1e-5, (family, rel_err(got, want))
    assert rel_err(got, loader) < 1e-5, (family, rel_err(got, loader))


def test_missing_keys_take_llama_cpp_defaults_with_one_note(made, tmp_path, capsys):
    ref, folder, _ = made("gemma3")
    path = write_like_llama_cpp(ref, folder, str(tmp_path / "bare.gguf"), "gemma3",
                                skip_keys=("attention.sliding_window", "rope.freq_base"))
    capsys.readouterr()  # what building the model printed (transformers' progress bar, where this test builds it)
    cfg = read_config(path)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (512, 1000000.0, 10000.0)
    assert cfg.layer_types == ["sliding"] * 5 + ["full"] and cfg.attn_scale == 256 ** -0.5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention.sliding_window = 512" in err and "rope.freq_base = 1000000.0" in err


@pytest.mark.parametrize("ftype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_and_reexport(family, ftype, made, tmp_path):
    """safetensors -> GGUF -> load: the same logits (f32 exactly, the others within their rounding); a GGUF
    import exported again holds the same tensors and metadata as the file it came from."""
    ref, folder, path = made(family)
    model, _ = load_model(folder, lora=LoRAConfig(r=2))
    randomize_lora_b(model)
    out = save_gguf(model, load_tokenizer(folder), str(tmp_path / f"m.{ftype}.gguf"), ftype=ftype)
    back, _ = load_model(out)
    with torch.no_grad():
        err = rel_err(back(IDS), model(IDS))
    assert err < {"f32": 1e-6, "f16": 5e-3, "bf16": 3e-2, "q8_0": 3e-2}[ftype], (family, ftype, err)
    if ftype == "f32":
        again = save_gguf(load_model(path)[0], load_tokenizer(path), str(tmp_path / "again.gguf"), ftype="f32")
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(again)
        assert {t.name: t.data.tobytes() for t in a.tensors} == {t.name: t.data.tobytes() for t in b.tensors}
        for key, f in a.fields.items():
            if key.startswith(f"{family}.") or key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.pre":
                assert b.fields[key].contents() == f.contents(), key


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_of_a_gguf_base_loads_in_transformers(family, made, tmp_path):
    from transformers import AutoModelForCausalLM
    _, _, path = made(family)
    model, _ = load_model(path, lora=LoRAConfig(r=2))
    randomize_lora_b(model)
    merge_and_save(model, path, str(tmp_path / "merged"))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel_err(ref(IDS).logits, model(IDS)) < 1e-5
