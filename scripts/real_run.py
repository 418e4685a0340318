"""A real model learns: the GRPO and the DPO runs of docs/rl.md and docs/preference.md, each one command that runs
nanotune's own scripts in turn and ends with a before/after summary.

    G=$(python scripts/fetch_smollm2.py)
    python scripts/real_run.py rl  --model "$G" --out runs/rl      # GRPO on builtin:arithmetic, then its reward plot
    python scripts/real_run.py dpo --model "$G" --out runs/dpo     # pairs from the model's own answers, then DPO

rl: `rl.py` on --data (builtin:arithmetic), --steps steps of 8 prompts x G = 8 completions of at most 32 tokens,
evaluated greedily on 192 held-out prompts at step 0, every 50 steps and at the end (eval_pass@1), then
`scripts/plot.py` draws the reward curve (needs matplotlib; skipped, saying so, without it). The summary: the
mean reward of the first and last 10 steps, held-out pass@1 before and after.

dpo: `scripts/make_pairs.py` builds pairs from the model's greedy answers to --data's train and eval rows (the
builtin dataset by default: chosen = the row's answer, rejected = the model's), `train.py --method` (dpo) trains
on them with the eval pairs held out, and `make_pairs.py --score` compares the answer accuracy of the base and the
tuned model on the eval rows. The summary: the held-out preference accuracy (eval_rewards/accuracies) at step 0
and at the end, and the answer accuracy before and after.

Everything goes under --out (metrics.jsonl, the adapter, the pairs, reward.png); options after `--` go to rl.py or
train.py as they are (e.g. `-- --device cpu --dtype float32`). --quick runs a handful of steps on a few rows: a
check that the commands run, not a result.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    """Run one of nanotune's scripts (a path under the repo root, then its options); stop on its failure."""
    cmd = [sys.executable, os.path.join(ROOT, args[0]), *map(str, args[1:])]
    print("$", " ".join(cmd[1:]), flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:
        sys.exit(f"error: {args[0]} failed (exit status {status}); see its output above")


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_and_last(rows, key):
    """(the first and the last value of `key` in the rows that have it), None where none has it."""
    values = [r[key] for r in rows if key in r]
    return (values[0], values[-1]) if values else (None, None)


def real_rl(args, extra):
    steps, eval_every = (4, 2) if args.quick else (args.steps, 50)
    prompts, G, tokens = (2, 2, 8) if args.quick else (8, 8, 32)
    run("rl.py", "--model", args.model, "--data", args.data, "--out-dir", args.out, "--max-steps", steps,
        "--batch-size", prompts, "--num-generations", G, "--max-new-tokens", tokens, "--lr", args.lr,
        "--eval-every", eval_every, "--eval-batches", 1 if args.quick else 3, "--save-every", 0, *extra)
    rows = records(args.out)
    rewards = [r["reward"] for r in rows if "loss" in r]
    n = min(10, len(rewards))
    before, after = first_and_last(rows, "eval_pass@1")
    print(f"rl on {args.data}: {len(rewards)} steps, mean reward of the first {n} {sum(rewards[:n]) / n:.3f}, of "
          f"the last {n} {sum(rewards[-n:]) / n:.3f}; held-out pass@1 {before:.1%} -> {after:.1%} (greedy)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('no reward plot: plot.py needs matplotlib (pip install -e ".[plot]")')
        return
    run("scripts/plot.py", args.out, "--png", os.path.join(args.out, "reward.png"))


def real_dpo(args, extra):
    train_rows, eval_rows, steps = (4, 4, 2) if args.quick else (400, 100, args.steps)
    os.makedirs(args.out, exist_ok=True)
    pairs = {split: os.path.join(args.out, f"{split}_pairs.jsonl") for split in ("train", "eval")}
    data = {split: ["--split", split] if args.data == "builtin" else ["--data", f"{args.data}:{split}"]
            for split in ("train", "eval")}
    new_tokens = 8 if args.quick else 24
    for split, n in (("train", train_rows), ("eval", eval_rows)):
        run("scripts/make_pairs.py", "--model", args.model, *data[split], "--max-examples", n, "--max-new-tokens",
            new_tokens, "--out", pairs[split], "--overwrite")
    run_dir = os.path.join(args.out, args.method)
    run("train.py", "--model", args.model, "--method", args.method, "--data", pairs["train"], "--eval-data",
        pairs["eval"], "--out-dir", run_dir, "--max-steps", steps, "--lr", args.lr, "--warmup-steps", 0 if args.quick
        else 5, "--eval-every", max(1, steps // 4), "--eval-batches", eval_rows, "--max-len", 256, "--save-every", 0,
        *extra)
    before, after = first_and_last(records(run_dir), "eval_rewards/accuracies")
    print(f"{args.method}: held-out preference accuracy (eval_rewards/accuracies) {before:.1%} -> {after:.1%}")
    run("scripts/make_pairs.py", "--model", args.model, *data["eval"], "--max-examples", eval_rows,
        "--max-new-tokens", new_tokens, "--score", os.path.join(run_dir, "adapter"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", choices=("rl", "dpo"), help="rl: GRPO on rl.py; dpo: make_pairs.py, then train.py")
    p.add_argument("--model", required=True, help="the model: a .gguf file, a folder or a short name")
    p.add_argument("--out", required=True, help="the folder that every output goes to")
    p.add_argument("--data", default=None, help="rl: builtin:arithmetic (default) or any --data of rl.py; dpo: "
                   "builtin (default) or a builtin dataset with train and eval splits (builtin:arithmetic)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: rl 200, dpo 60)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: rl 1e-3, dpo 5e-5)")
    p.add_argument("--method", default="dpo", help="dpo: the preference loss for train.py --method (dpo, ipo, "
                   "simpo, orpo)")
    p.add_argument("--quick", action="store_true", help="a few steps on a few rows: checks that the commands run")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rl = args.run == "rl"
    args.data = args.data or ("builtin:arithmetic" if rl else "builtin")
    args.steps = args.steps or (200 if rl else 60)
    args.lr = args.lr or (1e-3 if rl else 5e-5)
    (real_rl if rl else real_dpo)(args, extra)


if __name__ == "__main__":
    main()
