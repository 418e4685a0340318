"""Preference pairs for DPO from prompt/answer rows and a model's own answers; and the answer accuracy of a
model with and without an adapter on the same rows.

    G=$(python scripts/fetch_smollm2.py)
    python scripts/make_pairs.py --model "$G" --split train --max-examples 200 --out train_pairs.jsonl
    python scripts/make_pairs.py --model "$G" --split eval --max-examples 40 --out eval_pairs.jsonl
    python train.py --model "$G" --method dpo --data train_pairs.jsonl --eval-data eval_pairs.jsonl
    python scripts/make_pairs.py --model "$G" --split eval --max-examples 100 --score out/adapter

Each row's prompt is rendered as supervised fine-tuning renders it (data.held_out_prompt: the chat template,
BOS), and the model answers it greedily, with a KV cache, in at most --max-new-tokens tokens. A pair's chosen
answer is the row's own answer, exactly; its rejected answer is the model's. A row that the model already
answers exactly (the same text after strip) gives no pair, nor does an empty answer; both are counted.

With a chat template the pairs are TRL's conversational form: the prompt's messages, then one assistant
message on each side. Without one they are plain text: the prompt as SFT renders it (the Alpaca prompt),
then each answer. Either way train.py --method dpo renders a pair's prompt into the same tokens as SFT
renders the row's (tests/test_make_pairs.py checks it), so the pairs teach the model on the prompts it sees.

--score ADAPTER writes nothing: it prints the share of the rows that the base model, then the base with the
adapter (model.adapters.load_with_adapter), answers exactly (greedy, the same text after strip).
"""
import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from cli import HelpFormatter, add_tokenizer, auto_device, run_tool  # noqa: E402
from data import held_out_prompt, load_examples, prompt_and_answer  # noqa: E402
from model import load_tokenizer  # noqa: E402
from model.adapters import load_with_adapter  # noqa: E402
from model.files import atomic_file, check_new_output  # noqa: E402
from model.generate import generate, stop_ids  # noqa: E402


def greedy_answers(model, tokenizer, mcfg, rows, max_new_tokens, desc):
    """[(row, prompt ids, the model's greedy answer as text, without its stop token)] for each row that has a
    prompt before its answer (data.held_out_prompt)."""
    stops, out = stop_ids(tokenizer, mcfg), []
    model.eval()
    for row in tqdm(rows, desc=desc, unit="row", file=sys.stderr, disable=None, leave=False):
        case = held_out_prompt(row, tokenizer)
        if case is None:
            continue
        ids = generate(model, case[1], max_new_tokens, stop_ids=stops)
        out.append((row, case[1], tokenizer.decode([t for t in ids if t not in stops])))
    return out


def make_pairs(model, tokenizer, mcfg, rows, max_new_tokens):
    """(pairs, counts): a {"prompt", "chosen", "rejected"} pair for each row whose greedy answer differs from
    its own; counts: {"rows", "no_prompt", "same", "empty"}, what was left out and why."""
    answered = greedy_answers(model, tokenizer, mcfg, rows, max_new_tokens, "answering")
    pairs, counts = [], {"rows": len(rows), "no_prompt": len(rows) - len(answered), "same": 0, "empty": 0}
    for row, _, answer in answered:
        prompt, reference = prompt_and_answer(row, tokenizer)
        if not answer.strip() or answer.strip() == reference.strip():
            counts["empty" if not answer.strip() else "same"] += 1
            continue
        if isinstance(prompt, list):  # conversational: one assistant message on each side
            chosen, rejected = ([{"role": "assistant", "content": text}] for text in (reference, answer))
        else:
            chosen, rejected = reference, answer
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs, counts


def exact_matches(model, tokenizer, mcfg, rows, max_new_tokens, desc):
    """(how many rows the model answers exactly, greedy, the same text after strip; how many were asked)."""
    answered = greedy_answers(model, tokenizer, mcfg, rows, max_new_tokens, desc)
    right = sum(answer.strip() == prompt_and_answer(row, tokenizer)[1].strip() for row, _, answer in answered)
    return right, len(answered)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="local folder, short name, hub repo id or .gguf file")
    p.add_argument("--data", default="builtin", help="prompt/answer rows: what train.py --data takes")
    p.add_argument("--split", choices=("train", "eval"), default=None,
                   help="the builtin dataset's split (default: train); other data names its own in --data")
    p.add_argument("--max-examples", type=int, default=None, help="use only the first N rows (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="the longest answer the model gives, in tokens")
    p.add_argument("--out", default=None, help="the pairs' .jsonl file (required unless --score)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--score", metavar="ADAPTER", default=None,
                   help="write no pairs: print the answer accuracy of the base model and of the base with this "
                        "adapter folder")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    add_tokenizer(p)
    args = p.parse_args(argv)
    if args.split is not None and args.data != "builtin":
        raise ValueError(f"--split picks a split of the builtin dataset; for --data {args.data!r} name the rows "
                         "in --data itself")
    if args.max_examples is not None and args.max_examples < 1:
        raise ValueError(f"--max-examples must be at least 1, got {args.max_examples}")
    if args.score is None:
        if args.out is None:
            raise ValueError("--out FILE.jsonl is required: where to write the pairs (or pass --score ADAPTER)")
        check_new_output(args.out, args.overwrite)
    spec = f"builtin:{args.split or 'train'}" if args.data == "builtin" else args.data
    rows = load_examples(spec, max_examples=args.max_examples)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    device = torch.device(auto_device() if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32

    if args.score is not None:
        results = []
        for adapter in (None, args.score):
            model, mcfg = load_with_adapter(args.model, adapter, dtype=dtype, device=device)
            results.append(exact_matches(model, tokenizer, mcfg, rows, args.max_new_tokens, "scoring"))
        (base, n), (tuned, _) = results
        print(f"answer accuracy on {n} rows of {spec} (greedy, exact match after strip): base {base}/{n} "
              f"({base / max(n, 1):.1%}), base + {args.score} {tuned}/{n} ({tuned / max(n, 1):.1%})")
        return

    model, mcfg = load_with_adapter(args.model, dtype=dtype, device=device)
    pairs, counts = make_pairs(model, tokenizer, mcfg, rows, args.max_new_tokens)
    with atomic_file(args.out) as f:
        f.write("".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs))
    print(f"{len(pairs)} pairs of {counts['rows']} rows of {spec} in {args.out}; dropped {counts['same']} that the "
          f"model already answers exactly, {counts['empty']} with an empty answer"
          + (f", {counts['no_prompt']} with no prompt before the answer" if counts["no_prompt"] else ""))


if __name__ == "__main__":
    run_tool(main)
