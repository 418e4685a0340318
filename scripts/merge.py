"""Merge a LoRA adapter into its base model and write a Hugging Face model folder.

    python scripts/merge.py --model tinyllama --adapter out/adapter --out tuned/
    python scripts/merge.py --model "$G" --adapter out/adapter --out tuned/ --dtype bf16 --push-to-hub me/tuned

The folder (safetensors shards, config.json, tokenizer files, chat template, a model card)
loads with transformers' AutoModelForCausalLM.from_pretrained and gives the same logits as
nanotune's model with the adapter. Every adapted projection is written as W + (alpha / r) · B @ A,
summed in fp32 and then cast to --dtype once. An adapter trained with --quantize nf4 is merged
into the same dequantized NF4 weights it was trained on, unless --base-precision full. A GGUF
--model (Llama, Qwen2/3, Gemma 1/2/3) gets a config.json written from its metadata; to go back to GGUF,
use scripts/export_gguf.py instead. The folder is written whole or not at all; write errors
(disk full, a read-only folder, a file-size limit) are one line.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from cli import HelpFormatter, add_push_to_hub, add_tokenizer, run_tool  # noqa: E402
from model.adapters import (  # noqa: E402
    BASE_PRECISION_HELP,
    BASE_PRECISIONS,
    adapter_tokenizer,
    check_replaceable,
    load_with_adapter,
    merge_and_save,
)
from model.files import check_writable_parent  # noqa: E402
from model.hub import base_model_id, check_push, model_card, push  # noqa: E402
from model.load import load_tokenizer  # noqa: E402
from model.lora import quantization  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
USAGE = """```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this repo or folder>")
```"""


def checkpoint_dtype(model) -> str:
    """The dtype the base checkpoint was saved in (config.json's dtype / torch_dtype); bf16 for a GGUF."""
    hf = getattr(model, "hf_config", None) or {}
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(hf.get("dtype") or hf.get("torch_dtype"),
                                                                          "bf16")


def merge(model_path, adapter, out, dtype="auto", base_precision="as-trained", tokenizer=None):
    """Load `model_path` in fp32 with `adapter`, and write it merged to the folder `out` in `dtype`
    ("auto": `checkpoint_dtype`), with the tokenizer files of `tokenizer` (default: `model_path`'s, and over
    them the adapter's own tokenizer, when it added tokens). Returns the model card written with it."""
    model, _ = load_with_adapter(model_path, adapter, base_precision)  # fp32: the merge is summed in full precision
    dtype = checkpoint_dtype(model) if dtype == "auto" else dtype
    base = {None: "full precision", "nf4": "dequantized NF4, as the adapter was trained"}[quantization(model)]
    card = model_card(base_model_id(model_path), "finetune", library_name="transformers",
                      options={"merged into": base, "dtype": dtype}, usage=USAGE)
    added = adapter_tokenizer(adapter) if tokenizer is None else None
    merge_and_save(model, tokenizer or model_path, out, dtype=DTYPES[dtype], card=card,
                   tokenizer=load_tokenizer(added) if added else None)
    return card


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="base model: local folder, short name, hub repo id or .gguf file")
    p.add_argument("--adapter", required=True, help="LoRA adapter folder (PEFT format, e.g. out/adapter)")
    p.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="dtype of the written weights (default: %(default)s, the base checkpoint's own; bf16 for "
                        "a GGUF base)")
    p.add_argument("--base-precision", default="as-trained", choices=BASE_PRECISIONS, help=BASE_PRECISION_HELP)
    add_tokenizer(p)
    add_push_to_hub(p, "the folder")
    args = p.parse_args(argv)
    check_replaceable(args.out)
    check_writable_parent(args.out)
    if args.push_to_hub:
        check_push(args.push_to_hub)
    merge(args.model, args.adapter, args.out, args.dtype, args.base_precision, args.tokenizer)
    print(f"wrote {args.out}")
    if args.push_to_hub:
        print(f"pushed to {push(args.out, args.push_to_hub)}")


if __name__ == "__main__":
    run_tool(main)
