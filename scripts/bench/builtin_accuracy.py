"""Before/after accuracy of a fine-tune on the builtin dataset, in one command (CPU or GPU).

    G=$(python scripts/fetch_smollm2.py)
    python scripts/bench/builtin_accuracy.py --model "$G" --out-dir /tmp/bt -- \\
        --max-steps 30 --max-len 256 --batch-size 4 --lr 1e-3 --eval-batches 10
    python scripts/bench/builtin_accuracy.py --model tinyllama --json tinyllama.json -- --max-steps 60

It runs train.py in its own process (--data builtin; the options after `--` are passed on) and
reports:
  - the first and the last eval of the run, read from its metrics.jsonl: loss, answer accuracy
    (teacher-forced exact match of the whole answer, `data.answer_accuracy`) and token accuracy;
  - the wall time of a training step: the median gap between consecutive step lines of train.py's
    output, leaving out gaps that hold an eval or a checkpoint, so loading and evaluation are not
    counted;
  - for the first held-out question of each task, the greedy answer before (the base model) and
    after (with the adapter);
  - with --per-task, the answer accuracy of each task over the whole eval split, before and after.
    The builtin tasks take turns, so held-out example i belongs to task i % (number of tasks).
The extra evaluations load the model once, with the adapter's LoRA shape; its B matrices start at
zero, so before the adapter is loaded the model is the base model exactly. docs/builtin-dataset.md
holds the figures for SmolLM2-135M on a CPU.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repo root, for `data` and `model`

import data  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from model.adapters import load_adapter, read_adapter_config  # noqa: E402
from model.generate import encode_prompt, generate, stop_ids  # noqa: E402

STEP_LINE = re.compile(r"^step (\d+)/\d+")


def run_train(model, out_dir, train_args):
    """Run train.py, echoing its output; (exit status, [(seconds, line)]) with each line's arrival time."""
    cmd = [sys.executable, "-u", os.path.join(ROOT, "train.py"), "--model", model, "--data", "builtin",
           "--out-dir", out_dir, "--overwrite", *train_args]
    print("$ " + " ".join(cmd), flush=True)
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            print(line, end="", flush=True)
    return proc.returncode, lines


def step_seconds(lines):
    """Median seconds between consecutive step lines that have only training between them."""
    gaps, last = [], None
    for t, line in lines:
        if STEP_LINE.match(line):
            if last is not None:
                gaps.append(t - last)
            last = t
        else:  # an eval, a checkpoint or any other work: the next gap is not a pure step
            last = None
    return statistics.median(gaps) if gaps else None


def evals(out_dir):
    """The eval records of the run's metrics.jsonl, in order."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval_accuracy" in r]


def by_task(examples):
    """{task name: its examples}; the builtin tasks take turns, one example each."""
    groups = {}
    for i, ex in enumerate(examples):
        groups.setdefault(data._TASKS[i % len(data._TASKS)].__name__.strip("_"), []).append(ex)
    return groups


@torch.no_grad()
def answer_accuracy(model, tokenizer, examples, cfg, device):
    """The share of `examples` whose whole answer the model gets right, teacher-forced, batched as train.py does."""
    enc = [data.encode_example(ex, tokenizer, system_prompt=cfg["system_prompt"]) for ex in examples]
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    correct = total = 0
    for b in data.eval_batches(enc, batch_size=cfg["batch_size"], max_len=cfg["max_len"], pad_id=pad,
                               packing=cfg["packing"]):
        b = {k: v.to(device) for k, v in b.items()}
        _, hit = model.score(b["input_ids"], b["position_ids"], b["doc_ids"], b["targets"])  # (B, T)
        c, t = data.answer_accuracy(hit, b)
        correct, total = correct + c, total + t
    return correct / max(total, 1)


def answers(model, tokenizer, examples, stop, max_new_tokens, system_prompt):
    """The greedy answer to each example's question (the user turn training sees)."""
    out = []
    for ex in examples:
        question = data.alpaca_messages(ex)[0]["content"]
        ids = generate(model, encode_prompt(tokenizer, question, system=system_prompt), max_new_tokens,
                       stop_ids=stop)
        out.append(tokenizer.decode(ids).strip())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="what train.py --model takes (e.g. the SmolLM2 .gguf)")
    p.add_argument("--out-dir", default="out/builtin-accuracy", help="train.py's run folder (overwritten)")
    p.add_argument("--per-task", action="store_true", help="also each task's answer accuracy on the eval split, "
                                                           "before and after (two more passes over it)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="for the sample answers")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("train_args", nargs="*", help="after `--`: options passed on to train.py")
    args = p.parse_args()

    started = datetime.datetime.now().astimezone()
    rc, lines = run_train(args.model, args.out_dir, args.train_args)
    if rc != 0:
        sys.exit(f"error: train.py exited with status {rc}; its output is above")
    records = evals(args.out_dir)
    with open(os.path.join(args.out_dir, "train_config.json")) as f:
        cfg = json.load(f)
    adapter = os.path.join(args.out_dir, "adapter")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = load_tokenizer(args.model)
    model, mcfg = load_model(args.model, dtype=dtype, device=device, lora=read_adapter_config(adapter),
                             quantize=cfg["quantize"])
    model.eval()
    stop = stop_ids(tokenizer, mcfg)
    tasks = by_task(data.builtin_dataset("eval"))
    samples = [group[0] for group in tasks.values()]
    result = {"date": started.isoformat(timespec="seconds"), "model": args.model, "device": str(device),
              "train_args": args.train_args, "first_eval": records[0], "last_eval": records[-1],
              "seconds_per_step": step_seconds(lines), "samples": [], "per_task": {}}
    phases = {}
    for phase in ("before", "after"):
        if phase == "after":
            load_adapter(model, adapter)
        phases[phase] = answers(model, tokenizer, samples, stop, args.max_new_tokens, cfg["system_prompt"])
        if args.per_task:
            for name, group in tasks.items():
                result["per_task"].setdefault(name, {})[phase] = answer_accuracy(model, tokenizer, group, cfg, device)
    for ex, before, after in zip(samples, phases["before"], phases["after"]):
        result["samples"].append({"question": data.alpaca_messages(ex)[0]["content"], "answer": ex["output"],
                                  "before": before, "after": after})

    first, last = records[0], records[-1]
    print(f"\nbuiltin dataset, {args.model} on {device}, train.py {' '.join(args.train_args)}")
    print(f"{'eval at step':<16}{'loss':>8}{'answer acc':>12}{'token acc':>11}")
    for r in (first, last):
        print(f"{r['step']:<16}{r['eval_loss']:>8.4f}{r['eval_accuracy']:>12.1%}{r['eval_token_accuracy']:>11.1%}")
    sps = result["seconds_per_step"]
    print(f"wall time per step (median): {'n/a' if sps is None else f'{sps:.2f} s'}")
    if result["per_task"]:
        print(f"\n{'task':<44}{'before':>8}{'after':>8}")
        for name, acc in result["per_task"].items():
            print(f"{name:<44}{acc['before']:>8.0%}{acc['after']:>8.0%}")
    print()
    for s in result["samples"]:
        print(f"Q: {s['question']!r} (answer {s['answer']!r})\n   before: {s['before']!r}\n   after:  {s['after']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
