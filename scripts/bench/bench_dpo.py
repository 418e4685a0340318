"""Time train.py's DPO step (--method dpo) on synthetic preference pairs of a fixed length, to put beside TRL's
and Unsloth's DPO (../shared/anchors/trl_methods.py) on the same GPU.

    python scripts/bench/bench_dpo.py --model MODEL_DIR --tokenizer TOKENIZER_DIR --out OUT.json \
        [--pairs-per-step 8] [--prompt-len 256] [--completion-len 256] [--steps 10] [--warmup 3] [-- TRAIN_OPTIONS]

The pairs ask "What is a + b?" after filler sentences; the chosen completion gives the sum, the rejected one
a wrong sum, each followed by filler to about --completion-len tokens (the tokenizer's own count). train.py
packs whole pairs into rows of 2 × (prompt + completion) + 64 tokens, one pair a row, so a step of
--pairs-per-step rows trains exactly that many pairs. Timing: train.py's own tokens/s of each step (padded
tokens over the step's wall time), turned back into seconds per step; the median over the timed steps.
Real tokens/s counts the prompt twice (chosen and rejected each carry it), as TRL's padded batches do.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from model import load_tokenizer  # noqa: E402

WORDS = ("the river runs past a quiet town where people grow apples and count the boats that pass each "
         "morning before the market opens").split()


def filler(rng, tokenizer, text, target):
    """`text` followed by filler words until the tokenizer counts about `target` tokens."""
    words = []
    while len(tokenizer.encode(text + " " + " ".join(words))) < target:
        words.append(rng.choice(WORDS))
    return text + " " + " ".join(words) if words else text


def make_pairs(tokenizer, n, prompt_len, completion_len, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = filler(rng, tokenizer, "Read the notes, then answer.", prompt_len - 12) + f" What is {a} + {b}?"
        wrong = a + b + rng.choice((-11, -1, 1, 10))
        rows.append({"prompt": prompt,
                     "chosen": filler(rng, tokenizer, f" The answer is {a + b}.", completion_len),
                     "rejected": filler(rng, tokenizer, f" The answer is {wrong}.", completion_len)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="the tokenizer folder (default: the model's)")
    p.add_argument("--out", required=True, help="the JSON results to write")
    p.add_argument("--pairs-per-step", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--method", default="dpo")
    p.add_argument("train_options", nargs="*", help="more train.py options, after --")
    a = p.parse_args()
    tokenizer = load_tokenizer(a.tokenizer or a.model)
    total = a.warmup + a.steps
    rows = make_pairs(tokenizer, a.pairs_per_step * total + 16, a.prompt_len, a.completion_len)
    lengths = [len(tokenizer.encode(r["prompt"] + r[k])) for r in rows for k in ("chosen", "rejected")]
    max_len = max(lengths[i] + lengths[i + 1] for i in range(0, len(lengths), 2)) + 64
    work = tempfile.mkdtemp(prefix="bench-dpo-")
    data = os.path.join(work, "pairs.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out_dir = os.path.join(work, "out")
    cmd = [sys.executable, "train.py", "--model", a.model, "--method", a.method, "--data", data,
           "--max-len", str(max_len), "--batch-size", str(a.pairs_per_step), "--max-steps", str(total),
           "--warmup-steps", "0", "--log-every", "1", "--eval-every", "0", "--save-every", "0",
           "--eval-fraction", "0", "--sample-every", "0", "--out-dir", out_dir, "--overwrite", *a.train_options]
    if a.tokenizer:
        cmd += ["--tokenizer", a.tokenizer]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: train.py exit status {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    timed = steps[a.warmup:]
    padded = a.pairs_per_step * max_len  # one pair a row
    step_s = statistics.median(padded / r["tokens_per_s"] for r in timed)
    real = statistics.mean(lengths) * 2 * a.pairs_per_step
    result = {"method": a.method, "pairs_per_step": a.pairs_per_step, "prompt_len": a.prompt_len,
              "completion_len": a.completion_len, "max_len": max_len, "step_s_median": step_s,
              "tokens_per_s_real": real / step_s, "tokens_per_s_padded": padded / step_s,
              "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in steps),
              "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
              "rewards_accuracies_last": steps[-1].get("rewards/accuracies"), "command": cmd,
              "header": [line for line in proc.stdout.splitlines() if not line.startswith("step ")][:12]}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{a.method}: {step_s * 1e3:.1f} ms a step of {a.pairs_per_step} pairs, {real / step_s:,.0f} real tok/s "
          f"({padded / step_s:,.0f} padded), peak {result['peak_mem_gib']:.2f} GiB, loss {steps[0]['loss']:.4f} -> "
          f"{steps[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
