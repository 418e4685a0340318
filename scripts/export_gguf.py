"""Export a model, with a LoRA adapter merged in, as a GGUF file for llama.cpp, Ollama or LM Studio.

    python scripts/export_gguf.py --model smollm2.gguf --adapter out/adapter --out tuned.q8_0.gguf --ftype q8_0
    python scripts/export_gguf.py --model ./my-llama --out my-llama.f16.gguf
    llama-cli -m tuned.q8_0.gguf -p "Hello" -cnv          # or: python scripts/generate.py --model tuned.q8_0.gguf

--model is whatever train.py accepted (a folder, a short name, a hub id or a .gguf file);
--adapter is the PEFT-format folder train.py writes (out/adapter). Every adapted projection
is written as W + (alpha / r) · B @ A, in fp32 and then converted to --ftype: f16 and bf16
round each weight once; q8_0 stores blocks of 32 int8 weights with one fp16 scale (8.5 bits
a weight, llama.cpp's near-lossless type). Norms and biases stay f32, as llama.cpp keeps
them. The tokenizer (byte-level BPE) and chat template of --model are written with it.
Supported: Llama, Qwen2 and Gemma architectures (see model/gguf.py).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from model import load_model, load_tokenizer  # noqa: E402
from model.adapters import load_adapter, read_adapter_config  # noqa: E402
from model.gguf import FILE_TYPES, save_gguf  # noqa: E402


def export(model_path, out, adapter=None, ftype="f16"):
    """Load `model_path` in fp32 (plus `adapter`), and write it merged to `out` as GGUF. Returns `out`."""
    lora = read_adapter_config(adapter) if adapter else None
    model, _ = load_model(model_path, lora=lora)  # fp32: the merge is summed in full precision
    if adapter:
        load_adapter(model, adapter)
    save_gguf(model, load_tokenizer(model_path), out, ftype=ftype)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="base model: local folder, short name, hub repo id or .gguf file")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format, e.g. out/adapter) to merge in")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--ftype", default="f16", choices=sorted(FILE_TYPES),
                   help="type of the 2-D weights: f16 (default), bf16, q8_0 (half the size of f16) or f32")
    args = p.parse_args()
    try:
        print(f"wrote {export(args.model, args.out, args.adapter, args.ftype)}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
