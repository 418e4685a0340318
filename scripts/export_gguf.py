"""Export a model, with a LoRA adapter merged in, as a GGUF file for llama.cpp, Ollama or LM Studio.

    python scripts/export_gguf.py --model smollm2.gguf --adapter out/adapter --out tuned.q8_0.gguf --ftype q8_0
    python scripts/export_gguf.py --model ./my-llama --out my-llama.f16.gguf --push-to-hub me/my-llama-gguf
    llama-cli -m tuned.q8_0.gguf -p "Hello" -cnv          # or: python scripts/generate.py --model tuned.q8_0.gguf

--model is whatever train.py accepted (a folder, a short name, a hub id or a .gguf file);
--adapter is the PEFT-format folder train.py writes (out/adapter). Every adapted projection
is written as W + (alpha / r) · B @ A, in fp32 and then converted to --ftype: f16 and bf16
round each weight once; q8_0 stores blocks of 32 int8 weights with one fp16 scale (8.5 bits
a weight, llama.cpp's near-lossless type). Norms and biases stay f32, as llama.cpp keeps
them. The tokenizer (byte-level BPE, or SentencePiece for Llama 2 / Gemma) and chat template of
--model (or --tokenizer) are written with it, and a
.gguf --model's general.* metadata (name, license, ...). An adapter trained with --quantize
nf4 is merged into the same dequantized NF4 weights it was trained on, unless
--base-precision full. Supported: Llama, Qwen2/3 and Gemma 1/2/3 architectures (see model/gguf.py).
An existing --out is replaced only with --overwrite, and never when it is the --model file
itself; the file is written whole or not at all.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from cli import HelpFormatter, add_push_to_hub, add_tokenizer, run_tool  # noqa: E402
from model import load_tokenizer  # noqa: E402
from model.adapters import BASE_PRECISION_HELP, BASE_PRECISIONS, adapter_tokenizer, load_with_adapter  # noqa: E402
from model.files import check_new_output  # noqa: E402
from model.hub import base_model_id, check_push, model_card, push  # noqa: E402

try:  # the gguf extra: without it, one line that says how to install it
    from model.gguf import FILE_TYPES
    from model.gguf_export import gguf_vocab, save_gguf
except ImportError as e:
    sys.exit(f"error: {e}")


def export(model_path, out, adapter=None, ftype="f16", base_precision="as-trained", tokenizer=None):
    """Load `model_path` in fp32 (plus `adapter`), and write it merged to `out` as GGUF, with the tokenizer
    of `tokenizer` (default: the adapter's own, when it added tokens, else `model_path`'s). Returns `out`."""
    tok = load_tokenizer(tokenizer or adapter_tokenizer(adapter) or model_path)  # an adapter's own: new tokens
    gguf_vocab(tok)  # a tokenizer llama.cpp cannot reproduce is refused before the model loads
    model, _ = load_with_adapter(model_path, adapter, base_precision)  # fp32: the merge is summed in full precision
    return save_gguf(model, tok, out, ftype=ftype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="base model: local folder, short name, hub repo id or .gguf file")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format, e.g. out/adapter) to merge in")
    p.add_argument("--out", required=True, help="the .gguf file to write (new, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (never the --model file)")
    p.add_argument("--ftype", default="f16", choices=sorted(FILE_TYPES),
                   help="type of the 2-D weights (default: %(default)s); q8_0 is half the size of f16")
    p.add_argument("--base-precision", default="as-trained", choices=BASE_PRECISIONS, help=BASE_PRECISION_HELP)
    add_tokenizer(p)
    add_push_to_hub(p, "the file")
    args = p.parse_args(argv)
    if not args.out.endswith(".gguf"):
        raise ValueError(f"--out {args.out!r}: name the file *.gguf, as llama.cpp and nanotune expect")
    check_new_output(args.out, args.overwrite, inputs=(args.model,))
    if args.push_to_hub:
        check_push(args.push_to_hub)
    print(f"wrote {export(args.model, args.out, args.adapter, args.ftype, args.base_precision, args.tokenizer)}")
    if args.push_to_hub:
        card = model_card(base_model_id(args.model), "quantized", options={"file": os.path.basename(args.out),
                                                                             "type": args.ftype},
                          usage=f"```\nllama-cli -hf {args.push_to_hub} -cnv\n```")
        print(f"pushed to {push(args.out, args.push_to_hub, card=card)}")


if __name__ == "__main__":
    run_tool(main)
