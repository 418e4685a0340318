"""Putting checkpoint tensors into a model built on the meta device: the code that the
safetensors loader (model/load.py) and the GGUF loader (model/gguf.py) share.

A loader builds `Transformer(cfg)` under `torch.device("meta")`, asks `expected_tensors`
what the checkpoint must hold, hands each tensor it reads to `place_tensor` (cast, moved,
NF4-quantized where asked), then calls `check_complete` and `finish_model` (tied
embeddings, the LoRA weights, which parameters train).
"""
import os

import torch
import torch.nn as nn

from model.lora import LoRALinear, init_lora_, is_lora_param
from model.variants import init_adapter_

QUANTIZE_CHOICES = (None, "nf4")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor and what was expected."""


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (llama.cpp's format) rather than a model folder or hub id."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf")


def check_quantize(quantize):
    """`quantize` is None (base weights in the model dtype) or "nf4" (QLoRA); anything else is refused."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or 'nf4' (4-bit NormalFloat, QLoRA), got {quantize!r}")


def expected_tensors(model, cfg, quantize):
    """(name -> shape of every base tensor a checkpoint must supply, names of the weights stored in NF4)."""
    expected = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False) if not is_lora_param(n)}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    nf4_keys = set()
    if quantize == "nf4":
        nf4_keys = {n + ".weight" for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    return expected, nf4_keys


def trainable_parameters(model):
    """(name, parameter) of every weight that trains: the LoRA weights first, then the model's own weights that
    train (the embeddings of --train-embeddings and --add-tokens, the base weights of --full). A tied head is the
    embedding's weight, listed once. The optimizer and checkpoints hold the weights in this order."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in params if is_lora_param(n)] + [(n, p) for n, p in params if not is_lora_param(n)]


def set_tensor(model, name, tensor):
    """Replace parameter `name` of `model` by `tensor`, keeping its requires_grad."""
    mod_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, pname, nn.Parameter(tensor, requires_grad=getattr(mod, pname).requires_grad))


def place_tensor(model, name, t, device, dtype, nf4_keys):
    """Cast `t` and put it into the meta-built model; a weight named in nf4_keys is quantized as it arrives."""
    t = t.to(device=device, dtype=dtype)
    if name in nf4_keys:
        from model.qlora import quantize_linear_  # imports bitsandbytes: only when asked
        quantize_linear_(model.get_submodule(name.removesuffix(".weight")), t)
    else:
        set_tensor(model, name, t)


def check_complete(expected, seen, where):
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where} is missing tensor(s) {missing[:5]}{more}")


def finish_model(model, cfg, device, lora_seed, train=None, fp8=False):
    """Tie embeddings, create the fp32 LoRA weights on `device` (the init of each adapter: `init_adapter_`, which
    may move its base weight), freeze the base (but for the base weights whose names the predicate `train` holds
    for: full fine-tuning, full.py), and pack the base weights of projections that share an input where they stay
    frozen (`Transformer.pack_weights_`). fp8: the base GEMMs in fp8 (model/fp8.py, `quantize_fp8_`)."""
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(lora_seed)
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.r:
            # Drawn on the CPU from one seeded generator: the same adapter init on every device.
            a, b = (torch.empty(p.shape, dtype=torch.float32) for p in (m.lora_A, m.lora_B))
            init_lora_(a, b, generator=gen)
            m.lora_A, m.lora_B = nn.Parameter(a.to(device)), nn.Parameter(b.to(device))
            if m.dora:
                m.lora_magnitude_vector = nn.Parameter(torch.empty(m.out_features, device=device))
            init_adapter_(m, generator=gen)
    for n, p in model.named_parameters():
        p.requires_grad_(is_lora_param(n) or (train is not None and train(n)))
    model.pack_weights_()
    if fp8:
        from model.fp8 import quantize_fp8_
        quantize_fp8_(model.projection_groups())
    model.eval()  # dropout off unless the training loop turns it on
