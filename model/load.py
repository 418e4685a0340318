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
from safetensors import safe_open
from safetensors import SafetensorError

from model.config import NAMED_MODELS, from_hf_config
from model.lora import LoRAConfig, LoRALinear
from model.tokenizer import load_tokenizer as _load_tokenizer_folder
from model.transformer import Transformer

# Files fetched from the hub: config, tokenizer and safetensors only (never .bin/.pth).
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]

# Tensors some checkpoints carry that are recomputed here and safe to skip.
IGNORED_KEYS = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor and what was expected."""


def resolve(name_or_path: str) -> str:
    """A local folder holding the checkpoint, downloading from the hub if needed."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in NAMED_MODELS:
        repo = NAMED_MODELS[name_or_path]
    elif name_or_path.count("/") == 1 and not os.path.exists(name_or_path) and not name_or_path.startswith((".", "/")):
        repo = name_or_path
    else:
        known = ", ".join(sorted(NAMED_MODELS))
        raise ValueError(f"unknown model {name_or_path!r}: not a local folder, a known short name or a hub "
                         f"repo id (user/name). Known short names: {known}")
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    local = "or pass a local folder with config.json and *.safetensors: --model /path/to/folder"
    try:
        return huggingface_hub.snapshot_download(repo, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"cannot download {repo!r}: the hub is unreachable (offline, or HF_HUB_OFFLINE=1) and it is not in "
            f"the local hub cache. Download it where there is network (`hf download {repo}`), {local}") from e
    except RepositoryNotFoundError as e:  # also gated and private repositories
        raise ValueError(
            f"cannot download {repo!r}: the hub has no such repository, or it is private or gated and this "
            f"machine is not logged in. Check the id on huggingface.co; for a gated model accept its licence "
            f"there, then `hf auth login` (or set HF_TOKEN); {local}") from e
    except HfHubHTTPError as e:
        raise ValueError(f"cannot download {repo!r}: the hub answered with an error ({e}). Try again later, "
                         f"{local}") from e


def read_hf_config(folder: str) -> dict:
    """config.json as a dict: kept on the model (`model.hf_config`) for merge_and_save to write back."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {folder!r}: a model folder needs config.json and "
                                "*.safetensors (as written by transformers' save_pretrained)")
    with open(path) as f:
        return json.load(f)


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


def _set_tensor(model, name, tensor):
    mod_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    old = mod._parameters[pname]
    mod._parameters[pname] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)


def load_model(name_or_path: str, dtype=torch.float32, device="cpu", lora: LoRAConfig | None = None,
               quantize: str | None = None, use_kernels: bool = False, lora_seed: int = 0,
               fused_lora: bool = True):
    """Build the model and load its weights. Returns (model, config).

    dtype is the dtype of the frozen base weights and of the activations; LoRA
    weights are always fp32 masters. quantize="nf4" stores frozen linear weights in
    4-bit NF4 (QLoRA). fused_lora: run projections through the fused LoRA autograd
    Functions (model/lora.py); False gives the plain-autograd reference path.
    """
    if quantize not in (None, "nf4"):
        raise ValueError(f"quantize must be None or 'nf4', got {quantize!r}")
    if isinstance(name_or_path, str) and name_or_path.endswith(".gguf"):
        from model.gguf import load_gguf
        return load_gguf(name_or_path, dtype=dtype, device=device, lora=lora, quantize=quantize,
                         use_kernels=use_kernels, lora_seed=lora_seed, fused_lora=fused_lora)
    folder = resolve(name_or_path)
    hf_config = read_hf_config(folder)
    cfg = from_hf_config(hf_config)
    files = safetensors_files(folder)
    with torch.device("meta"):
        model = Transformer(cfg, lora=lora, use_kernels=use_kernels, fused_lora=fused_lora)
    model.hf_config = hf_config
    expected, nf4_keys = expected_tensors(model, cfg, quantize)
    seen = set()
    for path in files:
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path!r} ({e}): the file is truncated or corrupt. Delete it and "
                                  "download it again (for the hub cache: huggingface-cli delete-cache, or "
                                  "snapshot_download(..., force_download=True))") from e
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
                                          "truncated or corrupt; download it again") from e
                if tuple(t.shape) != tuple(expected[key]):
                    raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, expected "
                                          f"{tuple(expected[key])} from config.json")
                place_tensor(model, key, t, device, dtype, nf4_keys)
                seen.add(key)
    check_complete(expected, seen, f"checkpoint {folder!r}")
    finish_model(model, cfg, device, lora_seed)
    return model, cfg


def expected_tensors(model, cfg, quantize):
    """(name -> shape of every base tensor a checkpoint must supply, names of the weights stored in NF4)."""
    expected = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False) if ".lora_" not in n}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    nf4_keys = set()
    if quantize == "nf4":
        nf4_keys = {n + ".weight" for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    return expected, nf4_keys


def place_tensor(model, name, t, device, dtype, nf4_keys):
    """Cast `t` and put it into the meta-built model; a weight named in nf4_keys is quantized as it arrives."""
    t = t.to(device=device, dtype=dtype)
    if name in nf4_keys:
        from model.qlora import quantize_linear_  # imports bitsandbytes: only when asked
        quantize_linear_(model.get_submodule(name.removesuffix(".weight")), t)
    else:
        _set_tensor(model, name, t)


def check_complete(expected, seen, where):
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where} is missing tensor(s) {missing[:5]}{more}")


def finish_model(model, cfg, device, lora_seed):
    """Tie embeddings, create the fp32 LoRA weights on `device`, and freeze the base."""
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(lora_seed)
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.r:
            a = torch.empty(m.lora_A.shape, dtype=torch.float32)
            bound = 1.0 / m.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) bound, as in nn.Linear / PEFT
            a.uniform_(-bound, bound, generator=gen)
            m.lora_A = torch.nn.Parameter(a.to(device))
            m.lora_B = torch.nn.Parameter(torch.zeros(m.lora_B.shape, dtype=torch.float32, device=device))
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    model.eval()  # dropout off unless the training loop turns it on


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model: short name, hub repo id, or local folder (or a .gguf file)."""
    if isinstance(name_or_path, str) and name_or_path.endswith(".gguf"):
        from model.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(name_or_path)
    return _load_tokenizer_folder(resolve(name_or_path))
