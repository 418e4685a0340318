"""Model configuration: one dataclass for every family, plus the short-name table.

Families differ only by the named fields of `ModelConfig`; the forward pass reads
those fields and never a family name. `from_hf_config` is the one place where a
Hugging Face `config.json` (whose keys differ per architecture and per
transformers version) is translated into those fields.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field

# Short name -> Hugging Face hub repo id. Looked up exactly; unknown names list these.
NAMED_MODELS = {
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-1b-instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2-0.5b": "Qwen/Qwen2-0.5B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "gemma-2b": "google/gemma-2b",
    "gemma-2-2b": "google/gemma-2-2b-it",
    "gemma-3-1b": "google/gemma-3-1b-it",
}

# HF `architectures[0]` / `model_type` values that nanotune implements.
SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # < n_heads for grouped-query attention
    head_dim: int  # set explicitly: Gemma's is not hidden_size / n_heads
    rms_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # --- RoPE ---
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma 3: sliding layers use another base
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} for full-attention layers
    # --- family numerics (the forward reads these, never a family name) ---
    norm_offset: float = 0.0  # Gemma norms scale by (1 + w): offset 1.0
    norm_cast: str = "llama"  # "llama": normalize in fp32, scale in input dtype; "gemma": all in fp32
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    act: str = "silu"  # "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU)
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v
    o_bias: bool = False  # Llama `attention_bias` puts one on o_proj as well
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # Qwen3 / Gemma 3: RMSNorm over head_dim on q and k
    sandwich_norm: bool = False  # Gemma 2/3: extra norms after attention and after the MLP
    # softmax scale; None -> head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    attn_softcap: float | None = None  # Gemma 2: scores <- c * tanh(scores / c)
    final_softcap: float | None = None  # Gemma 2: logits <- c * tanh(logits / c)
    sliding_window: int | None = None  # keys at distance >= window are masked on sliding layers
    layer_types: list = field(default_factory=list)  # per layer: "full" or "sliding"
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    # --- tokens ---
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"  # written back into config.json on export

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full"] * self.n_layers
        assert len(self.layer_types) == self.n_layers, "layer_types needs one entry per layer"
        assert self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        assert self.act in ("silu", "gelu_tanh", "gelu"), f"unknown activation {self.act!r}"
        assert self.norm_cast in ("llama", "gemma")

    def to_dict(self):
        return asdict(self)


# config.json keys every supported architecture has; the others have defaults.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(folder: str) -> dict:
    """A model folder's config.json as a dict."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {folder!r}: a model folder needs config.json and "
                                "*.safetensors (as written by transformers' save_pretrained)")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); restore it from where the model came from") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not the object of a transformers config")
    return hf


def _rope_params(hf):
    """(theta, local_theta, scaling) from either the transformers<5 keys
    (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) or the v5 `rope_parameters`."""
    rp = hf.get("rope_parameters")
    if rp:
        if "full_attention" in rp:  # per-layer-type parameters (Gemma 3 in transformers 5)
            full, local = rp["full_attention"], rp.get("sliding_attention")
        else:
            full, local = rp, None
        scaling = None if full.get("rope_type", "default") == "default" else dict(full)
        return full["rope_theta"], (local["rope_theta"] if local else None), scaling
    scaling = hf.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type"))
        if scaling["rope_type"] == "default":
            scaling = None
    return hf.get("rope_theta", 10000.0), hf.get("rope_local_base_freq"), scaling


def from_hf_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config.json (as a dict) into a ModelConfig. `source` names the
    file in error messages."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    mtype = hf.get("model_type")
    by_type = {v: k for k, v in SUPPORTED.items()}
    if arch not in SUPPORTED:
        if mtype in by_type:
            arch = by_type[mtype]
        elif mtype == "gemma3":  # the multimodal wrapper config: take its text part
            raise ValueError(
                "this is a multimodal Gemma 3 config; nanotune supports Gemma 3 text models "
                "(architectures ['Gemma3ForCausalLM'], e.g. google/gemma-3-1b-it)")
        else:
            raise ValueError(
                f"unsupported architecture {archs or mtype!r}; nanotune supports "
                f"{sorted(SUPPORTED)} (model_type {sorted(by_type)})")
    missing = [k for k in REQUIRED_KEYS if k not in hf]
    if missing:
        raise ValueError(f"{source} has no {missing[0]!r}, which every {arch} config.json sets: the file is "
                         "incomplete; restore it from where the model came from")
    family = SUPPORTED[arch]
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or H // nh
    n_layers = hf["num_hidden_layers"]
    theta, local_theta, scaling = _rope_params(hf)
    if scaling and scaling["rope_type"] not in ("llama3", "linear"):
        raise ValueError(f"rope_scaling type {scaling['rope_type']!r} is not supported "
                         "(supported: 'llama3', 'linear')")
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    act = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
           "gelu": "gelu"}.get(act_name)
    if act is None:
        raise ValueError(f"{source}: unsupported activation {act_name!r} (supported: silu, gelu, gelu_pytorch_tanh)")
    cfg = dict(
        vocab_size=hf["vocab_size"], hidden_size=H, intermediate_size=hf["intermediate_size"],
        n_layers=n_layers, n_heads=nh, n_kv_heads=hf.get("num_key_value_heads") or nh, head_dim=head_dim,
        rms_eps=hf.get("rms_norm_eps", 1e-6), max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=theta, rope_scaling=scaling, act=act,
        tie_embeddings=hf.get("tie_word_embeddings", family.startswith("gemma")),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"), architecture=arch,
    )
    if family in ("llama", "mistral"):
        cfg.update(qkv_bias=hf.get("attention_bias", False), o_bias=hf.get("attention_bias", False),
                   mlp_bias=hf.get("mlp_bias", False))
        if family == "mistral" and hf.get("sliding_window") is not None:
            # Mistral v0.1 declares a 4096 window; nanotune implements full attention for
            # Mistral-style models, which matches it for sequences up to the window.
            cfg["sliding_window"] = None
    elif family == "qwen2":
        cfg.update(qkv_bias=True)
    elif family == "qwen3":
        cfg.update(qkv_bias=hf.get("attention_bias", False), qk_norm=True)
    else:  # gemma, gemma2, gemma3_text
        # Gemma 1's config often says "gelu" but the reference implementation uses the tanh approximation.
        if family == "gemma" and act == "gelu":
            cfg["act"] = "gelu_tanh"
        cfg.update(norm_offset=1.0, norm_cast="gemma", embed_scale=math.sqrt(H))
    if family in ("gemma2", "gemma3_text"):
        types = hf.get("layer_types")
        if types is None:
            if family == "gemma2":  # even layers slide
                types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
            else:
                pattern = hf.get("sliding_window_pattern", 6)
                types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                         for i in range(n_layers)]
        cfg.update(
            sandwich_norm=True, attn_scale=hf.get("query_pre_attn_scalar", head_dim) ** -0.5,
            attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
            sliding_window=hf.get("sliding_window"),
            layer_types=["sliding" if t == "sliding_attention" else "full" for t in types],
        )
    if family == "gemma3_text":
        cfg.update(qk_norm=True, rope_local_theta=local_theta or 10000.0)
    return ModelConfig(**cfg)


# config.json's activation name for ModelConfig.act
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def to_hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face config.json (as a dict) for a config of a supported family, e.g. one read from
    a GGUF file; `from_hf_config` of it gives `cfg` back (checked). Other configs are refused."""
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
    if cfg.architecture not in model_type:
        raise ValueError(f"cannot write a config.json for {cfg.architecture}: nanotune writes one for "
                         f"{sorted(model_type)} (a model loaded from a folder keeps its own config.json)")
    hf = dict(
        architectures=[cfg.architecture], model_type=model_type[cfg.architecture], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, hidden_act=HF_ACTIVATIONS[cfg.act], tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )
    if hf["model_type"] == "llama":
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif hf["model_type"] in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False)
        if hf["model_type"] == "qwen3":
            hf.update(attention_bias=cfg.qkv_bias)
    else:
        hf.update(hidden_activation=HF_ACTIVATIONS[cfg.act])
    if cfg.sandwich_norm:  # Gemma 2 / 3
        # query_pre_attn_scalar is what the scale is computed from: a whole number for every Gemma.
        scalar = round(cfg.attn_scale ** -2) if cfg.attn_scale is not None else cfg.head_dim
        hf.update(query_pre_attn_scalar=scalar, attn_logit_softcapping=cfg.attn_softcap,
                  final_logit_softcapping=cfg.final_softcap, sliding_window=cfg.sliding_window,
                  layer_types=[f"{t}_attention" for t in cfg.layer_types])
    if cfg.rope_local_theta is not None:
        hf.update(rope_local_base_freq=cfg.rope_local_theta)
    if from_hf_config(hf) != cfg:
        differ = {k: v for k, v in from_hf_config(hf).to_dict().items() if v != getattr(cfg, k)}
        raise ValueError(f"cannot write this {cfg.architecture} config as config.json: it would read back with "
                         f"{differ}")
    return hf
