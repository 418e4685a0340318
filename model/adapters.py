"""Save, load and merge LoRA adapters, in the formats PEFT and transformers read.

    save_adapter(model, folder, base_model="tinyllama")   adapter weights, adapter_config.json, model card
    read_adapter_config(folder) -> LoRAConfig              to build a model that fits a saved adapter
    load_adapter(model, folder)                            copy a saved adapter into the model's LoRA weights
    load_with_adapter("tinyllama", folder)                 load_model + load_adapter, on the base it was trained on
    merge_and_save(model, tokenizer, out_folder)           a plain HF model folder with W + s·B·A folded in

The adapter folder is what `peft.PeftModel.save_pretrained` writes for a LoRA adapter on
a causal LM, so `PeftModel.from_pretrained(hf_model, folder)` loads it (and, since its
base_model_name_or_path is a hub repo id or an absolute path,
`AutoPeftModelForCausalLM.from_pretrained(folder)` finds the base by itself; PEFT cannot load a
.gguf base, and the card of an adapter on one says what can), and an
adapter PEFT trained loads here. Tensor keys are the nanotune parameter names under PEFT's
prefix, e.g.

    model.layers.0.self_attn.q_proj.lora_A  ->  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    model.layers.0.self_attn.q_proj.lora_magnitude_vector  ->  (the same prefix, no .weight: DoRA, use_dora true)

An adapter whose init moved the base (PiSSA, OLoRA: model/variants.py) is saved in PEFT's converted form, a
plain LoRA of rank 2r on the original base, so that it loads wherever the original base does.

Beside PEFT's files, `nanotune.json` records how the base was stored while training
({"quantize": "nf4"} for QLoRA). PEFT warns about keys it does not know in
adapter_config.json, so they live apart. Every tool that merges or runs an adapter
(`load_with_adapter`) loads the base as it was trained on: an adapter trained against NF4
weights learned to correct those weights, not the full-precision ones.

The merged folder (config.json, safetensors shards, tokenizer files, chat template) loads
with `transformers.AutoModelForCausalLM.from_pretrained`. NF4 weights are dequantized
before merging. A GGUF base has no config.json: one is written from its ModelConfig
(every supported family), and its tokenizer from the GGUF metadata.

Folders are written atomically (`atomic_folder`): a failed or interrupted write leaves the
previous folder, or none, never a half-written one.
"""
import json
import os
import re
import shutil
from contextlib import contextmanager

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.config import to_hf_config
from model.embeddings import EMBEDDINGS, embedding_parameters, load_embeddings_
from model.files import atomic_dir
from model.hub import base_model_id, model_card, resolve
from model.load import load_model, load_tokenizer
from model.lora import ALL_TARGETS, LoRAConfig, LoRALinear, lora_parameters, merged_weight, quantization
from model.tokenizer import Tokenizer
from model.variants import converted_adapter, moves_base
from model.weights import check_quantize, is_gguf

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAINING_CONFIG = "nanotune.json"  # {"quantize": None | "nf4"}: the base weights the adapter was trained on
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM.base_model (LoraModel).model (the HF model)
# Copied next to the merged weights when a tokenizer folder is given.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")
# PEFT options nanotune's LoRALinear cannot express (all off by default): an adapter that
# sets one would silently mean something else here, so it is refused.
UNSUPPORTED = ("fan_in_fan_out", "layers_to_transform", "rank_pattern", "alpha_pattern", "lora_bias")
# The modules PEFT may save whole (`modules_to_save`) that nanotune trains: the embeddings (model/embeddings.py).
MODULES_TO_SAVE = ("embed_tokens", "lm_head")
# PEFT inits that move the base weight: an adapter saved with one of them (not converted) needs that moved base.
BASE_MOVING_PEFT_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# --base-precision of the tools that load an adapter (generate, export_gguf, merge).
BASE_PRECISIONS = ("as-trained", "full")
BASE_PRECISION_HELP = ("the base weights the adapter is applied to: as-trained (default) uses the ones it was "
                       "trained on, i.e. the dequantized NF4 weights for an adapter trained with --quantize nf4 "
                       "(recorded in its nanotune.json); full uses the full-precision base")
ADAPTER_USAGE = """```python
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained("<this repo or folder>")
```"""
# PEFT cannot load a .gguf base by its path, so the card of an adapter on one says what does.
GGUF_ADAPTER_USAGE = """The base is a GGUF file, which `AutoPeftModelForCausalLM` cannot load. \
Merge the adapter with nanotune:

```
python scripts/merge.py --model {base} --adapter <this folder> --out merged/              # transformers
python scripts/export_gguf.py --model {base} --adapter <this folder> --out tuned.gguf    # llama.cpp
```

or, in transformers (which dequantizes the GGUF):

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{folder}", gguf_file="{file}")
model = PeftModel.from_pretrained(base, "<this folder>")
```"""


def check_replaceable(folder, marker=None):
    """An output folder may be written when it does not exist, is empty, or holds the file `marker`
    (an earlier output of the same kind, which it replaces); anything else is refused."""
    if not os.path.exists(folder) or (os.path.isdir(folder) and not os.listdir(folder)):
        return
    if marker is None or not os.path.isfile(os.path.join(folder, marker)):
        what = f"is not an earlier output of this kind (it has no {marker})" if marker else "is not empty"
        raise ValueError(f"{folder!r} exists and {what}; choose another output folder, or remove it")


@contextmanager
def atomic_folder(folder, marker=None):
    """Yield a new empty folder to write into. When the block succeeds it takes `folder`'s place
    whole (an older `folder` is removed); when it fails it is deleted (`model.files.atomic_dir`).
    `folder` must pass `check_replaceable(folder, marker)`."""
    check_replaceable(folder, marker)
    with atomic_dir(folder) as tmp:
        yield tmp


def adapter_key(name):
    """The PEFT key of nanotune's LoRA parameter `name` (PEFT's DoRA magnitude is a tensor without `.weight`)."""
    return PEFT_PREFIX + name + ("" if name.endswith(".lora_magnitude_vector") else ".weight")


def _lora_config(model) -> LoRAConfig:
    lora = getattr(model, "lora_config", None)
    if lora is None:
        raise ValueError("this model has no LoRA adapters: build it with load_model(..., lora=LoRAConfig(...))")
    return lora


def save_adapter(model, folder, base_model=None, dataset=None, options=None, metrics=None, tokenizer=None):
    """Write the LoRA weights (fp32), PEFT's adapter_config.json, nanotune.json and a model card
    README.md into `folder`, atomically. Trained embeddings (model/embeddings.py) are saved whole, as
    PEFT's modules_to_save; a tied pair as embed_tokens with ensure_weight_tying, which keeps PEFT's
    lm_head tied to it. tokenizer: written beside them (a vocabulary with new tokens).

    base_model: the model as the user named it (short name, hub repo id, folder or .gguf), recorded
    as PEFT's base_model_name_or_path in a form that loads anywhere (`base_model_id`).
    dataset, options (e.g. the training options), metrics (e.g. the final eval figures): for the card.
    """
    lora = _lora_config(model)
    base = base_model_id(base_model) if base_model is not None else None
    # Copies: a LoRA weight may view a shared storage (`pack_adapters_`), which safetensors refuses to write.
    tensors = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in lora_parameters(model)}
    r, alpha = lora.r, lora.alpha
    if moves_base(model):  # PiSSA, OLoRA: the rank-2r plain LoRA on the original base (model/variants.py)
        tensors, r, alpha = converted_adapter(model), 2 * r, alpha * (2 ** 0.5 if lora.rslora else 2)
    tensors = {adapter_key(n): t for n, t in tensors.items()}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": r, "lora_alpha": alpha, "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
        "use_dora": lora.dora, "target_modules": sorted(lora.targets), "bias": "none", "inference_mode": True,
    }
    embeddings = [(n, p) for n, p in embedding_parameters(model) if p.requires_grad]
    if embeddings:
        # PEFT looks up the tied lm_head's key too, so the tied pair is saved as PEFT saves it: twice.
        saved = embeddings + ([("lm_head.weight", embeddings[0][1])] if model.config.tie_embeddings else [])
        tensors.update({PEFT_PREFIX + n: p.detach().to("cpu", torch.float32, copy=True) for n, p in saved})
        config["modules_to_save"] = [n.split(".")[-2] for n, _ in embeddings]
        config["ensure_weight_tying"] = model.config.tie_embeddings
    quantize = quantization(model)
    precision = {None: "full precision", "nf4": "4-bit NF4 (QLoRA)"}[quantize]
    card = model_card(base, "adapter", library_name="peft", dataset=dataset,
                      options={"base weights": precision, "LoRA rank": lora.r, "LoRA alpha": lora.alpha,
                               "LoRA targets": ", ".join(sorted(lora.targets)), **(options or {})},
                      metrics=metrics, usage=_adapter_usage(base))
    with atomic_folder(folder, marker=ADAPTER_CONFIG) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, TRAINING_CONFIG), "w") as f:
            json.dump({"quantize": quantize}, f, indent=2)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(card)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)


def _adapter_usage(base):
    if base is None or not is_gguf(base):
        return ADAPTER_USAGE
    folder, file = os.path.split(base)
    return GGUF_ADAPTER_USAGE.format(base=base, folder=folder, file=file)


def adapter_quantization(folder) -> str | None:
    """How the base was stored when the adapter in `folder` was trained: None (full precision) or
    "nf4". An adapter without nanotune.json (e.g. one PEFT trained) counts as full precision."""
    path = os.path.join(folder, TRAINING_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        quantize = json.load(f).get("quantize")
    check_quantize(quantize)
    return quantize


def read_adapter_config(folder) -> LoRAConfig:
    """The LoRAConfig of a saved adapter (nanotune's or PEFT's)."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {folder!r}: an adapter folder holds {ADAPTER_CONFIG} "
                                f"and {ADAPTER_WEIGHTS}, as written by save_adapter or PEFT's save_pretrained")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the adapter folder is damaged") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} should hold a JSON object, not a {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}; nanotune loads LORA adapters only")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={cfg['bias']!r} trains base biases; nanotune adapters have bias 'none'")
    for key in UNSUPPORTED:
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={cfg[key]!r} is a PEFT option nanotune does not implement")
    saved = cfg.get("modules_to_save") or []
    if not isinstance(saved, list) or any(not isinstance(m, str) or m.split(".")[-1] not in MODULES_TO_SAVE
                                          for m in saved):
        raise ValueError(f"{path}: modules_to_save={saved!r}; nanotune trains and loads only "
                         f"{' and '.join(MODULES_TO_SAVE)} whole")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(BASE_MOVING_PEFT_INITS):
        raise ValueError(f"{path}: init_lora_weights={cfg['init_lora_weights']!r}: this adapter belongs to a base "
                         "that its init changed, not to the original one. Save it from PEFT with save_pretrained(..., "
                         "path_initial_model_for_weight_conversion=...), which converts it to a plain LoRA")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or any(t not in ALL_TARGETS for t in targets):
        raise ValueError(f"{path}: target_modules={targets!r}; nanotune expects a list of projection names "
                         f"from {list(ALL_TARGETS)}")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if key not in cfg or isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or \
                (key == "r" and not isinstance(value, int)):
            what = "a positive whole number" if key == "r" else "a positive number"
            raise ValueError(f"{path}: {key} is {'missing' if key not in cfg else repr(value)}; it must be {what}")
    return LoRAConfig(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                      targets=tuple(t for t in ALL_TARGETS if t in targets), rslora=cfg.get("use_rslora", False),
                      dora=bool(cfg.get("use_dora", False)))


def load_adapter(model, folder):
    """Copy the adapter saved in `folder` into the model's LoRA weights (names and shapes checked), and its
    embeddings, if it has them, into the model's (grown to their rows: an adapter with new tokens)."""
    want, have = read_adapter_config(folder), _lora_config(model)
    if (want.r, want.scale, set(want.targets), want.dora) != (have.r, have.scale, set(have.targets), have.dora):
        raise ValueError(
            f"adapter in {folder!r} has r={want.r}, scale={want.scale:g}, targets={list(want.targets)}, "
            f"dora={want.dora}, but the model was built with r={have.r}, scale={have.scale:g}, "
            f"targets={list(have.targets)}, dora={have.dora}. Build the "
            f"model for it: load_model(..., lora=read_adapter_config({folder!r}))")
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    tensors = load_file(path)
    embeddings = {n: tensors.pop(PEFT_PREFIX + n) for n in EMBEDDINGS if PEFT_PREFIX + n in tensors}
    params = {adapter_key(n): p for n, p in lora_parameters(model)}
    unexpected, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
    if unexpected or missing:
        raise ValueError(f"{path} does not fit this model: unexpected keys {unexpected[:3]}, missing keys "
                         f"{missing[:3]} ({len(unexpected)} and {len(missing)} in all). Was it trained on "
                         "another base model?")
    for key, p in params.items():
        rank_dim = 0 if key.endswith("lora_A.weight") else 1  # lora_A is (r, in), lora_B (out, r)
        got = tensors[key].shape
        if len(got) == 2 and got[1 - rank_dim] == p.shape[1 - rank_dim] and got[rank_dim] != p.shape[rank_dim]:
            raise ValueError(f"{path}: {key} has rank {got[rank_dim]}, but {ADAPTER_CONFIG} says r={want.r}; "
                             "the adapter's config and weights disagree: fix r in its config")
        if got != p.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, the model expects "
                             f"{tuple(p.shape)}. Was it trained on another base model?")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key])
    if embeddings:
        load_embeddings_(model, embeddings, path)


def load_with_adapter(name_or_path, adapter=None, base_precision="as-trained", **load_options):
    """load_model(name_or_path, **load_options) with the adapter saved in folder `adapter` loaded
    into it (no adapter: the base alone). base_precision="as-trained" loads the base as the adapter
    was trained on it (NF4 for a QLoRA adapter); "full" loads the full-precision base. Returns (model, config)."""
    if base_precision not in BASE_PRECISIONS:
        raise ValueError(f"base_precision must be one of {BASE_PRECISIONS}, got {base_precision!r}")
    if adapter is None:
        return load_model(name_or_path, **load_options)
    lora = read_adapter_config(adapter)
    quantize = adapter_quantization(adapter) if base_precision == "as-trained" else None
    if quantize == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ValueError(f"the adapter in {adapter!r} was trained on an NF4 base (QLoRA); loading that base "
                             "needs bitsandbytes (pip install bitsandbytes), or pass --base-precision full to use "
                             "the full-precision base") from e
    model, cfg = load_model(name_or_path, lora=lora, quantize=quantize, **load_options)
    load_adapter(model, adapter)
    return model, cfg


def merged_tensors(model):
    """(Hugging Face name, tensor) of the merged model, one tensor at a time."""
    tied = model.config.tie_embeddings
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield f"{name}.weight", merged_weight(m, torch.float32)
            if m.bias is not None:
                yield f"{name}.bias", m.bias
            continue
        for pname, p in m.named_parameters(recurse=False):
            if not (tied and name == "lm_head"):  # HF ties it to embed_tokens on load
                yield f"{name}.{pname}", p


def save_tokenizer(tokenizer: Tokenizer, folder):
    """Write `tokenizer` as a Hugging Face tokenizer: tokenizer.json, tokenizer_config.json (special
    tokens, chat template) and chat_template.jinja, which transformers and model/tokenizer.py read."""
    tokenizer.tok.save(os.path.join(folder, "tokenizer.json"))

    def text(i):
        return None if i is None else tokenizer.id_to_token(i)

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_id),
              "eos_token": text(tokenizer.eos_id), "pad_token": text(tokenizer.pad_id),
              "add_bos_token": tokenizer.add_bos, "add_eos_token": False}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(tokenizer.chat_template)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def adapter_tokenizer(folder):
    """The folder that holds the tokenizer of the adapter in `folder`: the adapter's own, for one that added
    tokens (it holds tokenizer.json), else None (the base's)."""
    return folder if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


def merge_and_save(model, tokenizer_from, out_folder, max_shard_bytes=2 << 30, dtype=None, card=None, marker=None,
                   tokenizer=None):
    """Write a Hugging Face model folder with the adapter merged into the base weights, atomically.

    tokenizer_from: a model folder (or a name load_model accepts) whose tokenizer files and
    generation_config.json are copied, a .gguf file whose tokenizer is written out, or None.
    dtype: of the written weights (default: the model's); merges are summed in fp32 first.
    card: the README.md to write, or None. tokenizer: a Tokenizer written over the copied tokenizer files
    (one with added tokens). out_folder must not exist, or be empty, or hold the file `marker` (an earlier
    output that it replaces). The model itself is left unchanged.
    """
    hf_config = getattr(model, "hf_config", None) or to_hf_config(model.config)  # a GGUF has no config.json
    dtype = dtype or model.model.embed_tokens.weight.dtype  # every base tensor was loaded in this dtype
    with atomic_folder(out_folder, marker) as tmp:
        # Shards are written as they fill (host memory stays near one shard) and renamed at the
        # end, once their count is known.
        written, weight_map, shard, size, total = [], {}, {}, 0, 0
        for name, t in merged_tensors(model):
            t = t.detach().to("cpu", dtype).contiguous()
            if shard and size + t.nbytes > max_shard_bytes:
                written.append(_write_shard(shard, tmp, len(written)))
                shard, size = {}, 0
            shard[name], size, total = t, size + t.nbytes, total + t.nbytes
            weight_map[name] = len(written)
        written.append(_write_shard(shard, tmp, len(written)))
        n = len(written)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for part, final in zip(written, names):
            os.replace(part, os.path.join(tmp, final))
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config = dict(hf_config)
        config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if is_gguf(tokenizer_from):
            save_tokenizer(load_tokenizer(tokenizer_from), tmp)
        elif tokenizer_from is not None:
            src = resolve(tokenizer_from)
            for fname in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(src, fname)):
                    shutil.copy(os.path.join(src, fname), os.path.join(tmp, fname))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        if card is not None:
            with open(os.path.join(tmp, "README.md"), "w") as f:
                f.write(card)


def _write_shard(tensors, folder, i):
    path = os.path.join(folder, f"model-part{i}.safetensors.tmp")
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:  # safetensors reports an I/O error only as text: "... (os error 28)"
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from e
    return path
