"""Draw the train and eval loss curves of a run to a PNG; for an RL run (rl.py: its records have `reward`), the
reward per step and the held-out pass@1 (`eval_pass@1`) instead.

    pip install -e ".[plot]"    # matplotlib: the only script-only dependency
    python scripts/plot.py out/ [--png out/loss.png]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from model.files import atomic_path  # noqa: E402


def curves(rows):
    """(rl, train, evals): whether the records are an RL run's (they have `reward`), and the (step, value) points of
    the training curve (`reward`, else `loss`) and of the held-out one (`eval_pass@1`, else `eval_loss`)."""
    rl = any("reward" in r for r in rows)
    train_key, eval_key = ("reward", "eval_pass@1") if rl else ("loss", "eval_loss")

    def points(key):
        return [(r["step"], r[key]) for r in rows if key in r]
    return rl, points(train_key), points(eval_key)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder (with metrics.jsonl) or a metrics.jsonl file")
    p.add_argument("--png", default=None, help="output image (default: <run>/loss.png)")
    args = p.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit('error: plot.py draws with matplotlib, which is not installed: pip install -e ".[plot]"')
    path = args.run if args.run.endswith(".jsonl") else os.path.join(args.run, "metrics.jsonl")
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read the run's records {path} ({e}); name a run folder or its metrics.jsonl")
    rl, train, evals = curves(rows)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="reward" if rl else "train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out pass@1 (greedy)" if rl else "eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (mean per completion); pass@1" if rl else "loss (mean per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = args.png or os.path.join(os.path.dirname(path), "reward.png" if rl else "loss.png")
    with atomic_path(out) as tmp:  # whole or not at all, never through a link planted at `out`
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=os.path.splitext(out)[1][1:] or "png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
