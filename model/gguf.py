"""GGUF, llama.cpp's single-file format: load Llama, Qwen2/3 and Gemma 1/2/3 checkpoints (writing them: gguf_export.py).

References: ggml's docs/gguf.md (the format); llama.cpp's convert_hf_to_gguf.py (tensor names,
the q/k permutation, Gemma's norms, `rope_freqs` for Llama 3 rope scaling) and llama-vocab.cpp
(the pre-tokenizer regexes); gguf-py (`GGUFWriter`, `quants`). The file's layout is read by model/gguf_file.py.

    model, cfg = load_model("SmolLM2-135M-Instruct.Q4_1.gguf")   # routed here by model.load
    tokenizer = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    save_gguf(model, tokenizer, "out.gguf", ftype="q8_0")          # model/gguf_export.py

A GGUF differs from a Hugging Face checkpoint in four ways, all undone on load and redone on save:
1. Names: `blk.{i}.attn_q.weight` for `model.layers.{i}.self_attn.q_proj.weight` (`GLOBAL_NAMES`,
   `LAYER_NAMES`), and shapes listed fastest dimension first (ggml's ne[0] is the row length), so
   a Linear weight [out, in] is listed as (in, out). The data itself is row-major [out, in].
2. Quantization: blocks of 32 or 256 weights share scales. Every type gguf-py can dequantize loads
   (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, Q2_K..Q6_K, IQ*); it is dequantized to fp32 once, then
   cast to the requested dtype. Export writes F32, F16, BF16 or Q8_0.
3. Rotary layout (Llama only): llama.cpp's "normal" rope rotates adjacent pairs (x0, x1), (x2, x3),
   ..., while Hugging Face's rotates halves (x_j, x_{j+d/2}). The converter therefore reorders the
   rows of each head of q_proj and k_proj (weights and biases) from [first half; second half] to
   interleaved: permute(w) = w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2). Loading applies the
   inverse, w.reshape(n_head, d/2, 2, ...).swapaxes(1, 2). Qwen2 and Gemma use llama.cpp's NEOX
   rope, which rotates halves, so their rows are stored as they are.
4. Gemma's norms: Hugging Face's GemmaRMSNorm scales by (1 + w); llama.cpp's converter stores
   1 + w and llama.cpp scales by the stored value (Gemma 3's q/k norms too; Qwen3's have no +1).
   Loading subtracts `cfg.norm_offset`, export adds it back. Gemma 2/3 have four norms a layer,
   and llama.cpp's `ffn_norm` is then the one before the MLP (`SANDWICH_NAMES`).

Some numbers are in no GGUF key, and llama.cpp hard-codes them (`Family`, `llama_cpp_fixed`): Gemma 2
slides on every other layer and Gemma 3 on 5 of every 6; Gemma 3's local rope base is 10000; the
attention scale is head_dim^-1/2 (Gemma 2/3 27B: (hidden / heads)^-1/2). A key llama.cpp has a
default for (a sliding window, a rope base, Gemma 2's softcaps) takes that default when absent,
said in one "note:" line. Export refuses a model whose numbers llama.cpp would compute otherwise.

The tokenizer is stored as metadata too: `tokenizer.ggml.tokens` / `merges` / `token_type`, the
special-token ids, the chat template, and `tokenizer.ggml.pre`, a name for the regex that splits
text before BPE. Byte-level BPE ("gpt2": Llama 3, Qwen2, SmolLM2, ...) is rebuilt with the
`tokenizers` library, with the splits of every `tokenizer.ggml.pre` name llama.cpp gives them;
SentencePiece ("llama": Llama 2, TinyLlama, Gemma) from `tokens` / `scores` / `token_type`, as
transformers converts a SentencePiece model (`_sentencepiece_tokenizer`).
"""
import math
import os
import sys
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache

import numpy as np
import torch

try:
    import gguf
except ImportError as e:  # an optional dependency: only GGUF files need it
    raise ImportError("reading or writing GGUF files needs the gguf package: pip install 'gguf>=0.10' "
                      "(or pip install -e '.[gguf]')") from e
from gguf import GGMLQuantizationType as QType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from model.config import ModelConfig
from model.gguf_file import GGUFFile
from model.lora import LoRAConfig
from model.tokenizer import Tokenizer
from model.transformer import Transformer, rope_inv_freq
from model.weights import CheckpointError, check_complete, check_quantize, expected_tensors, finish_model, place_tensor


@dataclass
class Family:
    hf_architecture: str  # ModelConfig.architecture, written back into config.json on export
    permuted_qk: bool  # llama.cpp's "normal" (interleaved) rope: q/k rows are permuted, see point 3
    numerics: dict = field(default_factory=dict)  # ModelConfig fields llama.cpp hard-codes for this arch
    embed_scale_sqrt: bool = False  # embeddings scaled by sqrt(hidden_size) (Gemma)
    # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1 (Gemma 2: every other layer,
    # Gemma 3: 5 of every 6); 0: no sliding layers.
    swa_pattern: int = 0
    # Block counts of the sizes whose attention scale llama.cpp takes as (hidden / heads)^-1/2, not
    # head_dim^-1/2 (Gemma 2 and 3 27B, whose query_pre_attn_scalar is hidden / heads).
    scale_by_hidden_at: tuple = ()
    # `{arch}.<key>` -> the value llama.cpp uses when the file has no such key.
    defaults: dict = field(default_factory=dict)


_GEMMA = {"norm_offset": 1.0, "norm_cast": "gemma", "act": "gelu_tanh"}
# GGUF `general.architecture` -> what its metadata does not say. Looked up exactly.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", permuted_qk=False, numerics={"qk_norm": True}),
    "gemma": Family("GemmaForCausalLM", permuted_qk=False, embed_scale_sqrt=True, numerics=_GEMMA),
    "gemma2": Family("Gemma2ForCausalLM", permuted_qk=False, embed_scale_sqrt=True,
                     numerics={**_GEMMA, "sandwich_norm": True}, swa_pattern=2, scale_by_hidden_at=(46,),
                     defaults={"rope.freq_base": 10000.0, "attention.sliding_window": 4096,
                               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": Family("Gemma3ForCausalLM", permuted_qk=False, embed_scale_sqrt=True,
                     numerics={**_GEMMA, "sandwich_norm": True, "qk_norm": True}, swa_pattern=6,
                     scale_by_hidden_at=(62,),
                     defaults={"rope.freq_base": 1000000.0, "rope.freq_base_swa": 10000.0,
                               "attention.sliding_window": 512}),
}

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_down.bias": "mlp.down_proj.bias",
}
# Gemma 2/3's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP, which Hugging Face
# names pre_feedforward_layernorm there (post_attention_layernorm normalizes the attention output).
SANDWICH_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: per-frequency divisors, read into cfg.rope_scaling

# general.* metadata that save_gguf writes itself; every other general.* key of a loaded file is kept.
OWN_GENERAL_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")

# Export types: --ftype name -> (ggml type of 2-D weights, llama.cpp's file type).
FILE_TYPES = {
    "f32": (QType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (QType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# The regexes llama.cpp splits text with before byte-level BPE, applied in turn (llama-vocab.cpp),
# by the name of the first `tokenizer.ggml.pre` value that uses them, which export writes. GPT-2's is
# the one the `tokenizers` ByteLevel pre-tokenizer has built in.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_SPLITS = {
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then GPT-2
    "llama-bpe": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
# Every `tokenizer.ggml.pre` that llama.cpp maps to one of the splits above -> that split's name.
PRE_TOKENIZER_NAMES = {
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de",
                     "jina-v2-code", "roberta-bpe", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
                     "trillion", "granite-docling"], "gpt-2"),
    # Written by earlier nanotune exports; llama.cpp itself knows the name only as "gpt-2".
    "gpt2": "gpt-2",
    # Files from converters that did not recognize the tokenizer. llama.cpp then uses an odd regex of its
    # own and warns that quality degrades; GPT-2's is what such (GPT-2 style) vocabularies were built with.
    "default": "gpt-2",
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], "smollm"),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "chatglm-bpe"],
                    "llama-bpe"),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "grok-2"], "qwen2"),
}
# llama.cpp's Llama 3 pre-tokenizers take a whole word that is itself a token before trying merges.
IGNORE_MERGES = ("llama-bpe",)
# Text that the splits above cut differently; export names a tokenizer's pre-tokenizer by its cuts.
_PRE_TOKENIZER_PROBE = "Hello world's WE'LL $foo  bar\n\n\t baz 12345 3.14 ¼ naïve 😀\r\n  end  "


# ----------------------------------------------------------------------------- reading


def _open(path):
    """The file's reader (`GGUFFile`). A run reads one file three times (its config, weights and tokenizer), and
    parsing its metadata (a vocabulary and its merges are ~10^5 strings) costs more than looking it up, so the last
    two files read are kept, each under its inode, size and modification time: a file written again at its path is
    read again."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    st = os.stat(path)
    return _reader(os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _reader(path, inode, size, mtime_ns):
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} as GGUF ({e}): the file is truncated or not a GGUF file; "
                              "download it again") from e


_REQUIRED = object()


def _meta(reader, key, default=_REQUIRED):
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise CheckpointError(f"GGUF metadata key {key!r} is missing; it is needed to build the model")
        return default
    return f.contents()


def general_metadata(reader) -> dict:
    """The file's `general.*` metadata (name, license, author, tags, ...) that export writes back:
    key -> (value, GGUF value type, item type of an array or None)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("general.") and key not in OWN_GENERAL_KEYS:
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            out[key] = (f.contents(), f.types[0], f.types[-1] if array else None)
    return out


def layer_names(cfg: ModelConfig) -> dict:
    """GGUF layer tensor names -> Hugging Face ones for this config (Gemma 2/3 name their norms apart)."""
    return SANDWICH_NAMES if cfg.sandwich_norm else LAYER_NAMES


def hf_name(gguf_name: str, names: dict = LAYER_NAMES) -> str:
    """The nanotune / Hugging Face parameter name of a GGUF tensor name (`names`: `layer_names(cfg)`)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # blk, layer index, layer names key
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    raise CheckpointError(f"GGUF tensor {gguf_name!r} has no counterpart in nanotune's model (known: "
                          f"{sorted(GLOBAL_NAMES)}, blk.N.{{{', '.join(names)}}})")


def read_tensor(t) -> torch.Tensor:
    """A GGUF tensor (any type gguf-py can dequantize) as fp32, in row-major [out, in] order."""
    shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the contiguous dimension first
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"tensor {t.name!r} has type {t.tensor_type.name}, which gguf {gguf.__version__} "
                              "cannot dequantize; upgrade gguf or requantize the file (e.g. to Q8_0)") from e
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved q/k rows -> Hugging Face's half-split rows (point 3 of the docstring)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's half-split q/k rows -> llama.cpp's interleaved rows (convert_hf_to_gguf's permute)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def scaling_from_rope_freqs(cfg: ModelConfig, factors: torch.Tensor) -> dict | None:
    """cfg.rope_scaling that reproduces llama.cpp's `rope_freqs` divisors f_i (inv_freq_i / f_i).

    convert_hf_to_gguf writes Llama 3 ("llama3") scaling only as these divisors. In
    `rope_inv_freq`, with x = 1/wavelength and s = (old_len * x - lo) / (hi - lo) = a*x - b:
    f = 1 where s >= 1, f = factor where s <= 0, and 1/f = (1 - s)/factor + s in between. So
    factor = max f, every in-between f gives s exactly, and f depends on (old_len, lo, hi) only
    through (a, b): lo = 1, hi = 1 + 1/b, old_len = a/b reproduce it. When fewer than two
    frequencies fall in between, (a, b) is any line that keeps the others on their side; the
    result is checked against the divisors either way.
    """
    f = factors.double()
    factor = f.max().item()
    if torch.allclose(f, torch.ones_like(f)):
        return None
    if torch.allclose(f, torch.full_like(f, factor)):
        return {"rope_type": "linear", "factor": factor}
    inv = rope_inv_freq(replace(cfg, rope_scaling=None), "full", "cpu").double()
    x = inv / (2 * math.pi)
    s = (1 / f - 1 / factor) / (1 - 1 / factor)
    between = (s > 1e-6) & (s < 1 - 1e-6)
    below, above = x[s <= 1e-6], x[s >= 1 - 1e-6]  # frequencies divided by `factor`, and left alone
    if between.sum() >= 2:
        (x1, x2), (s1, s2) = x[between][[0, -1]], s[between][[0, -1]]
        a = (s2 - s1) / (x2 - x1)
    elif between.sum() == 1:  # through (x1, s1), steep enough for s <= 0 below it and s >= 1 above it
        x1, s1 = x[between][0], s[between][0]
        slopes = []
        if len(below):
            slopes.append(s1 / (x1 - below.max()))
        if len(above):
            slopes.append((1 - s1) / (above.min() - x1))
        a = max(slopes)
    else:  # s = 0 at the highest divided frequency, 1 at the lowest one left alone
        x1, s1 = below.max(), 0.0
        a = 1 / (above.min() - x1)
    b = a * x1 - s1
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(1 + 1 / b),
               "original_max_position_embeddings": float(a / b)}
    got = rope_inv_freq(replace(cfg, rope_scaling=scaling), "full", "cpu").double()
    if not torch.allclose(got, inv / f, rtol=1e-5, atol=0):
        raise CheckpointError(f"{ROPE_FREQS} holds rope divisors that are not Llama 3 rope scaling "
                              f"({f.tolist()}); nanotune supports llama3 and linear rope scaling")
    return scaling


@cache
def _note(message):
    """Print `message` as one "note:" line on stderr, once per process (a file's config is read more than once)."""
    print(f"note: {message}", file=sys.stderr)


def read_gguf_config(path) -> ModelConfig:
    """The ModelConfig of a GGUF file."""
    return gguf_config(_open(path))


def gguf_config(reader) -> ModelConfig:
    """A ModelConfig from GGUF metadata (`{arch}.*`, `tokenizer.ggml.*`) and the tensors present."""
    arch = _meta(reader, "general.architecture")
    if arch not in FAMILIES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; nanotune loads {sorted(FAMILIES)}")
    fam = FAMILIES[arch]
    names = {t.name for t in reader.tensors}

    def get(key, default=_REQUIRED):
        return _meta(reader, f"{arch}.{key}", default)

    H, nh = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", H // nh)
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(f"{arch}.rope.dimension_count is {rope_dims} but head_dim is {head_dim}: partial "
                              "rotary embeddings are not supported")
    tokens = _meta(reader, "tokenizer.ggml.tokens", None)
    vocab = get("vocab_size", None if tokens is None else len(tokens))
    if vocab is None:
        raise CheckpointError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    defaulted = []

    def get_or_default(key):  # a key llama.cpp has a default for: that default, said once
        if f"{arch}.{key}" in reader.fields:
            return get(key)
        defaulted.append(f"{key} = {fam.defaults[key]}")
        return fam.defaults[key]

    n_layers = get("block_count")
    cfg = dict(
        vocab_size=vocab, hidden_size=H, intermediate_size=get("feed_forward_length"),
        n_layers=n_layers, n_heads=nh, n_kv_heads=get("attention.head_count_kv", nh), head_dim=head_dim,
        rms_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length", 2048),
        rope_theta=get_or_default("rope.freq_base") if "rope.freq_base" in fam.defaults else
        get("rope.freq_base", 10000.0),
        # Biases are whatever tensors the file has (Qwen2's q/k/v; Llama's attention_bias / mlp_bias).
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names, tie_embeddings="output.weight" not in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id", None),
        architecture=fam.hf_architecture, **fam.numerics,
    )
    if fam.embed_scale_sqrt:
        cfg["embed_scale"] = math.sqrt(H)
    if fam.swa_pattern:
        pattern = get("attention.sliding_window_pattern", fam.swa_pattern)
        sliding = ([i % pattern < pattern - 1 for i in range(n_layers)] if isinstance(pattern, int)
                   else [bool(b) for b in pattern])
        # No GGUF key holds the attention scale of these architectures: llama.cpp derives it from the size.
        scalar = H // nh if n_layers in fam.scale_by_hidden_at else head_dim
        cfg.update(sliding_window=get_or_default("attention.sliding_window"), attn_scale=scalar ** -0.5,
                   layer_types=["sliding" if b else "full" for b in sliding])
    for key, field_name in (("attn_logit_softcapping", "attn_softcap"),
                            ("final_logit_softcapping", "final_softcap")):
        if key in fam.defaults or f"{arch}.{key}" in reader.fields:
            cfg[field_name] = get_or_default(key)
    if "rope.freq_base_swa" in fam.defaults:
        cfg["rope_local_theta"] = get_or_default("rope.freq_base_swa")
    if defaulted:
        _note(f"this {arch} GGUF has no {', '.join(k.split(' =')[0] for k in defaulted)}; using llama.cpp's "
              f"defaults: {', '.join(defaulted)}")
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling != "none":
        raise CheckpointError(f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear, "
                              "and Llama 3 scaling stored as rope_freqs)")
    config = ModelConfig(**cfg)
    if ROPE_FREQS in names:
        factors = read_tensor(next(t for t in reader.tensors if t.name == ROPE_FREQS))
        config.rope_scaling = scaling_from_rope_freqs(config, factors)
    return config


def load_gguf(path, dtype=torch.float32, device="cpu", lora: LoRAConfig | None = None, quantize=None,
              use_kernels=False, lora_seed=0, fused_lora=True, gradient_checkpointing=False,
              offload_activations=False, train=None, fp8=False):
    """Build the model from a GGUF file and load its weights, dequantized to `dtype` (and requantized
    to NF4 with quantize="nf4"). Returns (model, config), like model.load.load_model, which routes
    *.gguf paths here."""
    check_quantize(quantize)
    reader = _open(path)
    cfg = gguf_config(reader)
    fam = FAMILIES[_meta(reader, "general.architecture")]
    names = layer_names(cfg)
    with torch.device("meta"):
        model = Transformer(cfg, lora=lora, use_kernels=use_kernels, fused_lora=fused_lora,
                            gradient_checkpointing=gradient_checkpointing, offload_activations=offload_activations)
    expected, nf4_keys = expected_tensors(model, cfg, quantize)
    seen = set()
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # already in cfg.rope_scaling
            continue
        name = hf_name(t.name, names)
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {t.name!r} ({name}) in {path!r}: this {cfg.architecture} "
                                  "config has no such parameter")
        w = read_tensor(t)
        if fam.permuted_qk and ".q_proj." in name:
            w = unpermute_rope(w, cfg.n_heads)
        elif fam.permuted_qk and ".k_proj." in name:
            w = unpermute_rope(w, cfg.n_kv_heads)
        if name.endswith("norm.weight"):
            w = w - cfg.norm_offset  # in fp32, before any cast
        if tuple(w.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {t.name!r} has shape {tuple(w.shape)}, expected {tuple(expected[name])} "
                                  "from the file's metadata")
        place_tensor(model, name, w, device, dtype, nf4_keys)
        seen.add(name)
    check_complete(expected, seen, repr(path))
    finish_model(model, cfg, device, lora_seed, train, fp8)
    model.gguf_metadata = general_metadata(reader)  # written back by save_gguf
    return model, cfg


def _byte_level_pre_tokenizer(split: str, add_prefix_space=False):
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[split]]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space,
                                                                      use_regex=False)])


def _split_of(pre: str) -> str:
    if pre not in PRE_TOKENIZER_NAMES:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{sorted(PRE_TOKENIZER_NAMES)}. Add its regexes (llama-vocab.cpp) to PRE_TOKENIZER_SPLITS")
    return PRE_TOKENIZER_NAMES[pre]


def sentencepiece_merges(tokens, scores) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule, which llama.cpp's "llama" tokenizer follows:
    repeatedly join the adjacent pair whose joined text is the token of highest score. Every split
    of every token into two tokens is a merge, ranked by the joined token's score, then its id
    (as transformers' converter ranks them, `generate_merges`)."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            if t[:k] in ids and t[k:] in ids:
                merges.append((-scores[i], i, k, t[:k], t[k:]))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _sentencepiece_tokenizer(reader) -> _HFTokenizer:
    """SentencePiece BPE ("llama": Llama 2, TinyLlama, Mistral, Gemma) as transformers converts it:
    spaces as "▁", one prepended to each run of text when add_space_prefix (llama.cpp prepends it
    after every special token too), and bytes <0xNN> for characters outside the vocabulary."""
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    # SentencePiece keeps a user-defined piece of spaces ("▁▁") in its "▁" form and finds it in the
    # normalized text, as transformers' conversion does; llama.cpp's converter writes it with spaces.
    tokens = [t.replace(" ", "▁") if k == gguf.TokenType.USER_DEFINED else t for t, k in zip(tokens, types)]
    scores = _meta(reader, "tokenizer.ggml.scores", None)
    if scores is None:
        raise CheckpointError("this GGUF's SentencePiece vocabulary has no tokenizer.ggml.scores, which decide how "
                              "text is split; convert the model again with llama.cpp's convert_hf_to_gguf.py")
    # SentencePiece and llama.cpp match user-defined pieces whole, before merging: their merges come first.
    scores = [math.inf if k == gguf.TokenType.USER_DEFINED else s for s, k in zip(scores, types)]
    unk = _meta(reader, "tokenizer.ggml.unknown_token_id", None)
    tok = _HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                  merges=sentencepiece_merges(tokens, scores), byte_fallback=True,
                                  unk_token=None if unk is None else tokens[unk], fuse_unk=True))
    space = bool(_meta(reader, "tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for "llama"
    steps = [normalizers.Prepend("▁")] if space else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if space else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _byte_level_tokenizer(reader) -> _HFTokenizer:
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _meta(reader, "tokenizer.ggml.merges")]
    split = _split_of(_meta(reader, "tokenizer.ggml.pre", "default"))
    unk = _meta(reader, "tokenizer.ggml.unknown_token_id", None)
    tok = _HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                  unk_token=None if unk is None else tokens[unk], ignore_merges=split in IGNORE_MERGES))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(split, bool(_meta(reader, "tokenizer.ggml.add_space_prefix", False)))
    tok.decoder = decoders.ByteLevel()
    return tok


# `tokenizer.ggml.model` -> how the tokenizer is rebuilt.
TOKENIZER_MODELS = {"gpt2": _byte_level_tokenizer, "llama": _sentencepiece_tokenizer}


def load_gguf_tokenizer(path) -> Tokenizer:
    """The tokenizer and chat template stored in a GGUF file's metadata."""
    reader = _open(path)
    kind = _meta(reader, "tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ValueError(f"{path!r} has a {kind!r} tokenizer; nanotune rebuilds byte-level BPE ('gpt2': Llama 3, "
                         "Qwen, SmolLM2) and SentencePiece ('llama': Llama 2, TinyLlama, Gemma) from GGUF. Pass the "
                         "model's Hugging Face folder as its tokenizer instead")
    tok = TOKENIZER_MODELS[kind](reader)
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    # Control tokens (<|im_start|>, SentencePiece's <unk>) are matched whole and skipped when decoding;
    # user-defined ones (<think>) are matched whole and kept, as llama.cpp does.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == gguf.TokenType.CONTROL or (kind == "llama" and k == gguf.TokenType.UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == gguf.TokenType.USER_DEFINED and not (kind == "llama" and " " in t)])
    return Tokenizer(tok=tok, bos_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
                     eos_id=_meta(reader, "tokenizer.ggml.eos_token_id", None),
                     pad_id=_meta(reader, "tokenizer.ggml.padding_token_id", None),
                     chat_template=_meta(reader, "tokenizer.chat_template", None),
                     add_bos=bool(_meta(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
                     add_eos=bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)))
