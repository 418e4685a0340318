"""Sample from a model (optionally with a LoRA adapter), with a KV cache.

    python scripts/generate.py --model smollm2.gguf --prompt "Name three rivers in Europe."
    python scripts/generate.py --model tinyllama --adapter out/adapter --prompt "..." --temperature 0.7
    python scripts/generate.py --model ./base --raw --prompt "Once upon a time"   # no chat template

--prompt is sent as one user message through the model's chat template (with
--add-generation-prompt, i.e. the assistant header), unless --raw. Generation stops at the
tokenizer's EOS or after --max-new-tokens. An adapter trained with --quantize nf4 runs on the
NF4 base it was trained on, unless --base-precision full. The sampling and the KV cache live
in model/generate.py.
"""
import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from cli import HelpFormatter, add_tokenizer, auto_device, run_tool  # noqa: E402
from model import load_tokenizer  # noqa: E402
from model.adapters import BASE_PRECISION_HELP, BASE_PRECISIONS, adapter_tokenizer, load_with_adapter  # noqa: E402
from model.generate import encode_prompt, generate, stop_ids  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="local folder, short name, hub repo id or .gguf file")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format, e.g. out/adapter)")
    p.add_argument("--prompt", required=True, help="the user message (or the raw text with --raw)")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: continue --prompt as plain text")
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (deterministic, the default); 0.7 "
                                                                   "is a common choice for sampling")
    p.add_argument("--top-p", type=float, default=0.9, help="with temperature > 0: sample from the most likely "
                                                            "tokens holding this much probability (default: "
                                                            "%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    p.add_argument("--base-precision", default="as-trained", choices=BASE_PRECISIONS, help=BASE_PRECISION_HELP)
    add_tokenizer(p)
    args = p.parse_args()
    device = torch.device(auto_device() if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model, cfg = load_with_adapter(args.model, args.adapter, args.base_precision, dtype=dtype, device=device)
    tok = load_tokenizer(args.tokenizer or adapter_tokenizer(args.adapter) or args.model)  # new tokens: the adapter's
    ids = encode_prompt(tok, args.prompt, args.system, args.raw)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with tqdm(total=args.max_new_tokens, desc="generating", unit="tok", file=sys.stderr, disable=None,
              leave=False) as bar:  # on a terminal only (disable=None)
        out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_p, stop_ids(tok, cfg),
                       generator=gen, on_token=lambda _: bar.update(1))
    print(tok.decode(out))


if __name__ == "__main__":
    run_tool(main)
