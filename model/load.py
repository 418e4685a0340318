"""Loading Hugging Face-format checkpoints: short name, hub repo id, or local folder.

The model is built on the meta device (no random weights are allocated), then every
tensor of `model.safetensors` (or of the shards listed in
`model.safetensors.index.json`) is read one at a time, checked against the expected
name and shape, cast and moved to the target device. Peak host memory stays near one
tensor; with `quantize="nf4"` each frozen linear weight is quantized as it arrives, so
the full-precision model never sits on the device.
"""
import json
import os

import torch
from safetensors import SafetensorError, safe_open

from model.config import ModelConfig, from_hf_config, read_hf_config
from model.hub import base_model_id, resolve
from model.lora import LoRAConfig
from model.tokenizer import load_tokenizer as _load_tokenizer_folder
from model.transformer import Transformer
from model.weights import (
    CheckpointError,
    check_complete,
    check_quantize,
    expected_tensors,
    finish_model,
    is_gguf,
    place_tensor,
)

# Tensors some checkpoints carry that are recomputed here and safe to skip.
IGNORED_KEYS = ("rotary_emb.inv_freq",)


def read_config(name_or_path: str) -> ModelConfig:
    """The ModelConfig of a model folder, short name, hub repo id (config.json) or .gguf file (its metadata)."""
    path = resolve(name_or_path)
    if is_gguf(path):
        from model.gguf import read_gguf_config  # imports the optional gguf package
        return read_gguf_config(path)
    return from_hf_config(read_hf_config(path), source=os.path.join(path, "config.json"))


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors in {folder!r}. nanotune loads safetensors only; convert a "
                                "PyTorch .bin checkpoint with transformers: model.save_pretrained(dir, "
                                "safe_serialization=True)")
    return [os.path.join(folder, f) for f in found]


def _redownload(folder):
    """How to replace a damaged checkpoint file of `folder`."""
    where = base_model_id(folder)  # a hub repo id for a folder of the hub cache
    command = "" if os.path.isabs(where) else f" (`hf download {where} --force-download`)"
    return f"Delete it and download it again{command}"


def load_model(name_or_path: str, dtype=torch.float32, device="cpu", lora: LoRAConfig | None = None,
               quantize: str | None = None, use_kernels: bool = False, lora_seed: int = 0,
               fused_lora: bool = True, gradient_checkpointing: bool = False, offload_activations: bool = False,
               train=None, fp8: bool = False):
    """Build the model and load its weights. Returns (model, config).

    name_or_path: a model folder, short name, hub repo id, or .gguf file (read by model/gguf.py).
    dtype is the dtype of the frozen base weights and of the activations; LoRA
    weights are always fp32 masters. quantize="nf4" stores frozen linear weights in
    4-bit NF4 (QLoRA). fused_lora: run projections through the fused LoRA autograd
    Functions (model/lora.py); False gives the plain-autograd reference path.
    gradient_checkpointing, offload_activations: see `Transformer`.
    train: a predicate on parameter names, the base weights that train (full fine-tuning: full.py's
    `train_filter`); None: only LoRA weights train.
    fp8: the frozen projections' forward and input-gradient GEMMs in fp8 (model/fp8.py); needs torch._scaled_mm.
    """
    check_quantize(quantize)
    options = dict(lora=lora, use_kernels=use_kernels, fused_lora=fused_lora,
                   gradient_checkpointing=gradient_checkpointing, offload_activations=offload_activations)
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from model.gguf import load_gguf  # imports the optional gguf package
        return load_gguf(folder, dtype=dtype, device=device, quantize=quantize, lora_seed=lora_seed, train=train,
                         fp8=fp8, **options)
    hf_config = read_hf_config(folder)
    cfg = from_hf_config(hf_config, source=os.path.join(folder, "config.json"))
    files = safetensors_files(folder)
    with torch.device("meta"):
        model = Transformer(cfg, **options)
    model.hf_config = hf_config
    expected, nf4_keys = expected_tensors(model, cfg, quantize)
    seen = set()
    for path in files:
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path!r} ({e}): the file is truncated or corrupt. "
                                  f"{_redownload(folder)}") from e
        with f:
            for key in f.keys():
                if key.endswith(IGNORED_KEYS) or (cfg.tie_embeddings and key == "lm_head.weight"):
                    continue
                if key not in expected:
                    raise CheckpointError(f"unexpected tensor {key!r} in {os.path.basename(path)}: this "
                                          f"{cfg.architecture} model has no such parameter. Is config.json the "
                                          "one that belongs to these weights?")
                try:
                    t = f.get_tensor(key)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise CheckpointError(f"cannot read tensor {key!r} from {path!r} ({e}): the file is "
                                          f"truncated or corrupt. {_redownload(folder)}") from e
                if tuple(t.shape) != tuple(expected[key]):
                    raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, expected "
                                          f"{tuple(expected[key])} from config.json")
                place_tensor(model, key, t, device, dtype, nf4_keys)
                seen.add(key)
    check_complete(expected, seen, f"checkpoint {folder!r}")
    finish_model(model, cfg, device, lora_seed, train, fp8)
    return model, cfg


def random_model(cfg: ModelConfig, dtype=torch.float32, device="cpu", quantize: str | None = None,
                 lora_seed: int = 0, train=None, fp8: bool = False, **options):
    """A model of `cfg` built as `load_model` builds it, with stand-in base weights where a checkpoint's would go:
    N(0, 0.02²) from a generator of its own, so that the process's random state stays as it was. For runs that
    need the shapes and kernels of a model, not its weights (step.py's warm start). options: as for `load_model`."""
    check_quantize(quantize)
    with torch.device("meta"):
        model = Transformer(cfg, **options)
    expected, nf4_keys = expected_tensors(model, cfg, quantize)
    gen = torch.Generator(device).manual_seed(0)
    for name, shape in expected.items():
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
        place_tensor(model, name, t, device, dtype, nf4_keys)
    finish_model(model, cfg, device, lora_seed, train, fp8)
    return model


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model: short name, hub repo id, or local folder (or a .gguf file)."""
    path = resolve(name_or_path)
    if is_gguf(path):
        from model.gguf import load_gguf_tokenizer  # imports the optional gguf package
        return load_gguf_tokenizer(path)
    return _load_tokenizer_folder(path)
