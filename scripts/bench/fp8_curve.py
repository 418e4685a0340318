"""The loss curve of --fp8 beside the exact bf16 base: one fine-tune of a real model, run twice.

    python scripts/bench/fp8_curve.py --model path/to/SmolLM2-135M --out fp8_curve.jsonl
    python scripts/bench/fp8_curve.py --model smollm2.gguf --steps 200 -- --quantize nf4 --lr 2e-4

train.py runs the builtin data twice with the same seed and options (anything after `--` is passed to both), once
as is and once with --fp8, logging every step; each run's folder is a temporary one. The JSONL gets one line
per step, {"step", "loss_bf16", "loss_fp8"}. Printed: the max and mean |difference| of the two curves smoothed
by an exponential moving average (a step's loss is noisy; the question is whether the curves part).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train(model, steps, seed, out_dir, extra):
    """The per-step losses of one train.py run (a subprocess, as a user runs it)."""
    cmd = [sys.executable, str(REPO / "train.py"), "--model", model, "--max-steps", str(steps), "--seed", str(seed),
           "--log-every", "1", "--eval-every", "0", "--sample-every", "0", "--out-dir", out_dir, *extra]
    subprocess.run(cmd, check=True, cwd=REPO)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def smoothed(values, beta):
    """The exponential moving average of `values`, bias-corrected (as Adam corrects its moments)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder, .gguf file, short name or hub id (train.py's)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smooth", type=float, default=0.9, help="the moving average's beta")
    p.add_argument("--out", default="fp8_curve.jsonl", help="the JSONL of both curves")
    p.add_argument("extra", nargs="*", help="train.py options for both runs, after --")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        curves = {name: train(args.model, args.steps, args.seed, os.path.join(tmp, name), args.extra + flags)
                  for name, flags in (("bf16", []), ("fp8", ["--fp8"]))}
    steps = sorted(set(curves["bf16"]) & set(curves["fp8"]))
    with open(args.out, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss_bf16": curves["bf16"][s], "loss_fp8": curves["fp8"][s]}) + "\n")
    a, b = (smoothed([curves[n][s] for s in steps], args.smooth) for n in ("bf16", "fp8"))
    diff = [abs(x - y) for x, y in zip(a, b)]
    print(f"{len(steps)} steps; smoothed (beta {args.smooth}) |loss_fp8 - loss_bf16|: max {max(diff):.4f}, mean "
          f"{sum(diff) / len(diff):.4f}; final smoothed loss bf16 {a[-1]:.4f}, fp8 {b[-1]:.4f}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
