"""Save, load and merge LoRA adapters, in the formats PEFT and transformers read.

    save_adapter(model, folder, base_model=None)     adapter_model.safetensors + adapter_config.json
    read_adapter_config(folder) -> LoRAConfig        to build a model that fits a saved adapter
    load_adapter(model, folder)                      copy a saved adapter into the model's LoRA weights
    merge_and_save(model, tokenizer, out_folder)     a plain HF model folder with W + s·B·A folded in

The adapter folder is what `peft.PeftModel.save_pretrained` writes for a LoRA adapter on
a causal LM, so `PeftModel.from_pretrained(hf_model, folder)` loads it, and an adapter
PEFT trained loads here. Tensor keys are the nanotune parameter names under PEFT's
prefix, e.g.

    model.layers.0.self_attn.q_proj.lora_A  ->  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight

The merged folder (config.json, safetensors shards, tokenizer files) loads with
`transformers.AutoModelForCausalLM.from_pretrained`. NF4 weights are dequantized before
merging and written in the dtype they were quantized from.
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from model.hub import resolve
from model.lora import ALL_TARGETS, LoRAConfig, LoRALinear, lora_parameters, merged_weight

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM.base_model (LoraModel).model (the HF model)
# Copied next to the merged weights when a tokenizer folder is given.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")
# PEFT options nanotune's LoRALinear cannot express (all off by default): an adapter that
# sets one would silently mean something else here, so it is refused.
UNSUPPORTED = ("use_dora", "fan_in_fan_out", "layers_to_transform", "rank_pattern", "alpha_pattern",
               "modules_to_save", "lora_bias")


def adapter_key(name):
    """The PEFT key of nanotune's LoRA parameter `name`."""
    return PEFT_PREFIX + name + ".weight"


def _lora_config(model) -> LoRAConfig:
    lora = getattr(model, "lora_config", None)
    if lora is None:
        raise ValueError("this model has no LoRA adapters: build it with load_model(..., lora=LoRAConfig(...))")
    return lora


def save_adapter(model, folder, base_model=None):
    """Write the LoRA weights (fp32) and a PEFT adapter_config.json into `folder`."""
    lora = _lora_config(model)
    tensors = {adapter_key(n): p.detach().float().cpu().contiguous() for n, p in lora_parameters(model)}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
        "target_modules": sorted(lora.targets), "bias": "none", "inference_mode": True,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def read_adapter_config(folder) -> LoRAConfig:
    """The LoRAConfig of a saved adapter (nanotune's or PEFT's)."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {folder!r}: an adapter folder holds {ADAPTER_CONFIG} "
                                f"and {ADAPTER_WEIGHTS}, as written by save_adapter or PEFT's save_pretrained")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}; nanotune loads LORA adapters only")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={cfg['bias']!r} trains base biases; nanotune adapters have bias 'none'")
    for key in UNSUPPORTED:
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={cfg[key]!r} is a PEFT option nanotune does not implement")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or any(t not in ALL_TARGETS for t in targets):
        raise ValueError(f"{path}: target_modules={targets!r}; nanotune expects a list of projection names "
                         f"from {list(ALL_TARGETS)}")
    return LoRAConfig(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                      targets=tuple(t for t in ALL_TARGETS if t in targets), rslora=cfg.get("use_rslora", False))


def load_adapter(model, folder):
    """Copy the adapter saved in `folder` into the model's LoRA weights (names and shapes checked)."""
    want, have = read_adapter_config(folder), _lora_config(model)
    if (want.r, want.scale, set(want.targets)) != (have.r, have.scale, set(have.targets)):
        raise ValueError(
            f"adapter in {folder!r} has r={want.r}, scale={want.scale:g}, targets={list(want.targets)}, but the "
            f"model was built with r={have.r}, scale={have.scale:g}, targets={list(have.targets)}. Build the "
            f"model for it: load_model(..., lora=read_adapter_config({folder!r}))")
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    tensors = load_file(path)
    params = {adapter_key(n): p for n, p in lora_parameters(model)}
    unexpected, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
    if unexpected or missing:
        raise ValueError(f"{path} does not fit this model: unexpected keys {unexpected[:3]}, missing keys "
                         f"{missing[:3]} ({len(unexpected)} and {len(missing)} in all). Was it trained on "
                         "another base model?")
    for key, p in params.items():
        if tensors[key].shape != p.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, the model expects "
                             f"{tuple(p.shape)}. Was it trained on another base model?")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key])


def merged_tensors(model):
    """(Hugging Face name, tensor) of the merged model, one tensor at a time."""
    tied = model.config.tie_embeddings
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield f"{name}.weight", merged_weight(m)
            if m.bias is not None:
                yield f"{name}.bias", m.bias
            continue
        for pname, p in m.named_parameters(recurse=False):
            if not (tied and name == "lm_head"):  # HF ties it to embed_tokens on load
                yield f"{name}.{pname}", p


def merge_and_save(model, tokenizer_folder, out_folder, max_shard_bytes=2 << 30):
    """Write a Hugging Face model folder with the adapter merged into the base weights.

    tokenizer_folder: a folder (or a name load_model accepts) whose tokenizer files and
    generation_config.json are copied, or None. The model itself is left unchanged.
    """
    hf_config = getattr(model, "hf_config", None)
    if hf_config is None:
        raise ValueError("merge_and_save writes back the config.json the model was loaded from (model.hf_config, "
                         "set by load_model); this model has none")
    os.makedirs(out_folder, exist_ok=True)
    # Shards are written as they fill (host memory stays near one shard) and renamed at the
    # end, once their count is known.
    written, weight_map, shard, size, total = [], {}, {}, 0, 0
    for name, t in merged_tensors(model):
        t = t.detach().cpu().contiguous()
        if shard and size + t.nbytes > max_shard_bytes:
            written.append(_write_shard(shard, out_folder, len(written)))
            shard, size = {}, 0
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes
        weight_map[name] = len(written)
    written.append(_write_shard(shard, out_folder, len(written)))
    n = len(written)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, final in zip(written, names):
        os.replace(tmp, os.path.join(out_folder, final))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
        with open(os.path.join(out_folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    config = dict(hf_config)
    dtype = model.model.embed_tokens.weight.dtype  # every base tensor was loaded in this dtype
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_folder is not None:
        src = resolve(tokenizer_folder)
        for fname in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, fname)):
                shutil.copy(os.path.join(src, fname), os.path.join(out_folder, fname))


def _write_shard(tensors, folder, i):
    path = os.path.join(folder, f"model-part{i}.safetensors.tmp")
    save_file(tensors, path, metadata={"format": "pt"})
    return path
