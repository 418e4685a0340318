"""Writing GGUF: a model (its LoRA merged into the weights) and its tokenizer as llama.cpp reads them.

    save_gguf(model, tokenizer, "out.gguf", ftype="q8_0")

The names, layouts and conventions are model/gguf.py's, redone on save (its docstring says what a GGUF
stores where). Export refuses a model whose numbers llama.cpp would compute otherwise (`llama_cpp_fixed`), and
a tokenizer llama.cpp cannot reproduce.
"""
import json
import math
from dataclasses import replace

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tqdm import tqdm

from model.config import ModelConfig
from model.files import atomic_path
from model.gguf import (  # gguf: the optional package, imported there with the line that says how to install it
    _PRE_TOKENIZER_PROBE,
    FAMILIES,
    FILE_TYPES,
    PRE_TOKENIZER_SPLITS,
    ROPE_FREQS,
    QType,
    _byte_level_pre_tokenizer,
    gguf,
    layer_names,
    permute_rope,
    sentencepiece_merges,
)
from model.lora import LoRALinear, merged_weight
from model.tokenizer import Tokenizer
from model.transformer import rope_inv_freq


def llama_cpp_fixed(arch: str, cfg: ModelConfig) -> dict:
    """The ModelConfig fields that llama.cpp's `arch` computes with no matter what the file says:
    its hard-coded numerics, sliding-layer pattern, attention scale and features it lacks."""
    fam = FAMILIES[arch]
    fixed = {"qk_norm": False, "sandwich_norm": False, "attn_scale": None, "attn_softcap": None,
             "final_softcap": None, "sliding_window": None, "rope_local_theta": None,
             "layer_types": ["full"] * cfg.n_layers, "embed_scale": math.sqrt(cfg.hidden_size)
             if fam.embed_scale_sqrt else 1.0, **fam.numerics}
    if fam.swa_pattern:
        n = fam.swa_pattern
        scalar = cfg.hidden_size // cfg.n_heads if cfg.n_layers in fam.scale_by_hidden_at else cfg.head_dim
        fixed.update(attn_scale=scalar ** -0.5, sliding_window=cfg.sliding_window,
                     layer_types=["sliding" if i % n < n - 1 else "full" for i in range(cfg.n_layers)])
    for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        if key in fam.defaults:  # written into the file; llama.cpp applies one always
            fixed[name] = getattr(cfg, name) if getattr(cfg, name) is not None else fam.defaults[key]
    if "rope.freq_base_swa" in fam.defaults:
        fixed["rope_local_theta"] = fam.defaults["rope.freq_base_swa"]
    return fixed


def _gguf_arch(cfg: ModelConfig) -> str:
    """The GGUF architecture that computes what `cfg` computes; raises if there is none."""
    by_hf = {f.hf_architecture: a for a, f in FAMILIES.items()}
    if cfg.architecture not in by_hf:
        raise ValueError(f"cannot write {cfg.architecture} as GGUF: nanotune writes {sorted(by_hf)}")
    arch = by_hf[cfg.architecture]
    wrong = {k: getattr(cfg, k) for k, v in llama_cpp_fixed(arch, cfg).items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(f"cannot write this model as GGUF architecture {arch!r}: llama.cpp's {arch} computes "
                         f"with other values of {wrong}")
    return arch


def export_tensors(model):
    """(GGUF name, fp32 tensor as llama.cpp stores it) for every weight, LoRA merged in: W + s·B·A."""
    cfg = model.config
    fam = FAMILIES[_gguf_arch(cfg)]
    yield "token_embd.weight", model.model.embed_tokens.weight.detach().float()
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3":
        unscaled = rope_inv_freq(replace(cfg, rope_scaling=None), "full", "cpu")
        yield ROPE_FREQS, unscaled / rope_inv_freq(cfg, "full", "cpu")  # divisors, as convert_hf_to_gguf writes
    for i, layer in enumerate(model.model.layers):
        for key, name in layer_names(cfg).items():
            mod_name, _, pname = name.rpartition(".")
            try:
                mod = layer.get_submodule(mod_name)
            except AttributeError:  # a q/k norm or sandwich norm this family has not
                continue
            if getattr(mod, pname) is None:  # a bias it has not
                continue
            if isinstance(mod, LoRALinear) and pname == "weight":
                w = merged_weight(mod, torch.float32)  # W + s·B·A (an NF4 W dequantized)
            else:
                w = getattr(mod, pname).detach().float()
            if name.endswith("norm.weight"):
                w = w + cfg.norm_offset
            elif fam.permuted_qk and mod_name == "self_attn.q_proj":
                w = permute_rope(w, cfg.n_heads)
            elif fam.permuted_qk and mod_name == "self_attn.k_proj":
                w = permute_rope(w, cfg.n_kv_heads)
            yield f"blk.{i}.{key}", w
    yield "output_norm.weight", model.model.norm.weight.detach().float() + cfg.norm_offset
    if not cfg.tie_embeddings:
        yield "output.weight", model.lm_head.weight.detach().float()


def _encode(t: torch.Tensor, qtype):
    """(data, ggml type). 1-D tensors (norms, biases, rope_freqs) stay F32 as llama.cpp keeps them;
    rows that do not fill whole quantization blocks fall back to F16, as llama.cpp's converter does."""
    a = t.numpy()
    if a.ndim == 1:
        qtype = QType.F32
    elif a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] != 0:
        qtype = QType.F16
    return gguf.quants.quantize(a, qtype), qtype


def _byte_level_prefix_space(spec) -> bool:
    """Whether a byte-level BPE tokenizer.json puts a space before the text (GPT-2's add_prefix_space)."""
    pres = spec.get("pre_tokenizer") or {}
    pres = pres.get("pretokenizers", [pres]) if pres.get("type") == "Sequence" else [pres]
    return any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in pres)


def _pre_tokenizer_name(tok: _HFTokenizer, add_prefix_space: bool) -> str:
    """The `tokenizer.ggml.pre` name, as llama.cpp spells it, whose splits cut a probe text exactly as
    `tok` does. Decided by the cuts, not by llama.cpp's hash of the vocabulary, so a tokenizer that
    transformers rebuilt (with another hash) is still named."""
    if tok.pre_tokenizer is None:
        raise ValueError("the tokenizer has no pre-tokenizer; GGUF export needs a byte-level BPE tokenizer")
    want = [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(_PRE_TOKENIZER_PROBE)]
    for name in PRE_TOKENIZER_SPLITS:
        got = _byte_level_pre_tokenizer(name, add_prefix_space).pre_tokenize_str(_PRE_TOKENIZER_PROBE)
        if [w for w, _ in got] == want:
            return name
    raise ValueError(f"the tokenizer's pre-tokenizer splits text like none of {sorted(PRE_TOKENIZER_SPLITS)}, the "
                     "splits llama.cpp knows by name; llama.cpp could not tokenize as this model was trained")


def _steps(part) -> list:
    """The steps of a tokenizer.json normalizer / pre-tokenizer / decoder (one, a Sequence, or none)."""
    if not part:
        return []
    return part.get("normalizers") or part.get("pretokenizers") or part.get("decoders") or [part]


def _sentencepiece_layout(spec) -> bool | None:
    """For a tokenizer.json of a SentencePiece BPE model as transformers converts it (byte fallback,
    spaces as "▁"): whether it prepends "▁" to the text (add_space_prefix). None for any other kind."""
    model = spec["model"]
    norms, pres = _steps(spec.get("normalizer")), _steps(spec.get("pre_tokenizer"))
    meta = [p for p in pres if p["type"] == "Metaspace"]
    replaces = any(n["type"] == "Replace" and n["pattern"].get("String") == " " and n["content"] == "▁"
                   for n in norms)
    if model["type"] != "BPE" or not model.get("byte_fallback") or not (replaces or meta):
        return None
    return (any(n["type"] == "Prepend" and n["prepend"] == "▁" for n in norms)
            or any(p.get("prepend_scheme", "always") != "never" for p in meta))


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int | None = None) -> dict:
    """What `tokenizer.ggml.*` holds for `tokenizer`: byte-level BPE as "gpt2" (Llama 3, Qwen, SmolLM2),
    SentencePiece BPE as "llama" (Llama 2, TinyLlama, Gemma), with scores that make llama.cpp merge
    as the tokenizer does. Ids past the tokenizer's, up to the embedding's `vocab_size` rows, become
    unused "[PAD{i}]" tokens, as convert_hf_to_gguf writes them. Raises ValueError, in one line, for a
    tokenizer llama.cpp cannot reproduce. A normalizer (Qwen2's NFC) is not stored: llama.cpp has none
    for byte-level BPE."""
    spec = json.loads(tokenizer.tok.to_str())
    model = spec["model"]
    vocab_size = vocab_size or tokenizer.vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size} rows")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    added = {a["id"]: a["special"] for a in spec["added_tokens"]}
    unk = model.get("unk_token")
    unk_id = None if unk is None else tokenizer.token_to_id(unk)
    tokens = [tokenizer.id_to_token(i) for i in range(vocab_size)]
    T = gguf.TokenType
    types = [T.UNUSED if t is None else T.UNKNOWN if i == unk_id else T.CONTROL if added.get(i)
             else T.USER_DEFINED if i in added else T.NORMAL for i, t in enumerate(tokens)]
    tokens = [f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)]
    decoder = (spec.get("decoder") or {}).get("type")
    space = _sentencepiece_layout(spec)
    if model["type"] == "BPE" and decoder == "ByteLevel":
        prefix_space = _byte_level_prefix_space(spec)
        return {"model": "gpt2", "pre": _pre_tokenizer_name(tokenizer.tok, prefix_space), "tokens": tokens,
                "types": types, "merges": [" ".join(m) for m in merges], "unk": unk_id,
                "add_space_prefix": prefix_space}
    if space is None:
        raise ValueError(f"GGUF export writes byte-level BPE (Llama 3, Qwen, SmolLM2) and SentencePiece BPE with "
                         f"byte fallback (Llama 2, Gemma); this tokenizer is {model['type']} with decoder {decoder}, "
                         "which llama.cpp cannot reproduce")
    # SentencePiece: llama.cpp joins the adjacent pair whose joined token scores highest. A token's
    # score is minus the rank of the first merge that makes it; bytes, control and user tokens score 0.
    first = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
    scores = [-float(first[t]) if t in first else -float(len(merges) + i) if k == T.NORMAL else 0.0
              for i, (t, k) in enumerate(zip(tokens, types))]
    for i, t in enumerate(tokens):
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types[i] = T.BYTE
    if sentencepiece_merges(tokens, scores) != merges:
        raise ValueError("this SentencePiece tokenizer's merges are not the ones its vocabulary implies (every "
                         "split of a token, ranked by the token): llama.cpp would split text differently")
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores,
            "unk": unk_id, "add_space_prefix": space}


def _write_tokenizer(w, tokenizer: Tokenizer, vocab_size: int):
    """`tokenizer` as `tokenizer.ggml.*` metadata (`gguf_vocab`), with its special ids and chat template."""
    vocab = gguf_vocab(tokenizer, vocab_size)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    for add, i in ((w.add_bos_token_id, tokenizer.bos_id), (w.add_eos_token_id, tokenizer.eos_id),
                   (w.add_pad_token_id, tokenizer.pad_id), (w.add_unk_token_id, vocab["unk"])):
        if i is not None:
            add(i)
    # Always written: llama.cpp guesses when they are absent, and its guess adds BOS for some vocabularies.
    w.add_add_bos_token(tokenizer.add_bos)
    w.add_add_eos_token(tokenizer.add_eos)
    w.add_add_space_prefix(vocab["add_space_prefix"])
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


@torch.no_grad()
def save_gguf(model, tokenizer: Tokenizer, path, ftype="f16"):
    """Write `model` (any LoRA merged into its weights: W + scale * B @ A) and `tokenizer` as a
    GGUF file that llama.cpp and `load_gguf` read. ftype: f32, f16, bf16 or q8_0 for 2-D weights.
    A model loaded from a GGUF file keeps that file's general.* metadata (name, license, ...).
    The file is written whole or not at all (`model.files.atomic_path`)."""
    if ftype not in FILE_TYPES:
        raise ValueError(f"ftype must be one of {sorted(FILE_TYPES)}, got {ftype!r}")
    cfg = model.config
    arch = _gguf_arch(cfg)
    qtype, file_type = FILE_TYPES[ftype]
    w = gguf.GGUFWriter(None, arch)
    for key, (value, vtype, item_type) in getattr(model, "gguf_metadata", {}).items():
        w.add_key_value(key, value, vtype, sub_type=item_type)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.rope_local_theta is not None:
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
    if cfg.attn_softcap is not None:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.final_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_softcap)
    _write_tokenizer(w, tokenizer, cfg.vocab_size)
    for name, t in tqdm(export_tensors(model), desc="exporting", unit=" tensors", disable=None, leave=False):
        data, raw = _encode(t.cpu(), qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    with atomic_path(path) as tmp:
        try:
            w.write_header_to_file(path=tmp)
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path
