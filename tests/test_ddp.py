"""Data parallelism (issue 9), on CPU: `torchrun --nproc_per_node=2 train.py` with gloo.

2 ranks x batch 2 is the same optimization as 1 process x batch 4 (loss, eval and updated LoRA weights),
with gradient accumulation (DDP's no_sync) and gradient checkpointing on, and with one rank that has no
target token in the whole first step. A 2-rank run resumed from its checkpoint continues bit for bit.

Why the data lines up: each epoch's rows are shuffled once, the same on every rank; rank r takes places
r, r + 2, r + 4, ... of that order (data.Batches). So with 2 ranks, micro-step m of step s covers places
8s + 4m .. 8s + 4m + 3 between the two ranks, exactly the rows that 1 process with batch 4 takes.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import statefiles
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def masked_next(self, _next=data.Batches.__next__):
    """data.Batches.__next__, with the targets of step 1's rows at odd places masked. With 2 ranks those are
    all of rank 1's rows (places 1, 3, 5, 7), so rank 1 has no target token in either of its micro-steps."""
    batch = _next(self)
    if self.epoch == 0 and self.index <= 2:  # the first two batches: step 1 with --grad-accum 2
        place = torch.arange(len(batch["targets"])) * self.world_size + self.rank
        batch["targets"][place % 2 == 1] = data.IGNORE_INDEX
    return batch


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in data.builtin_dataset("train")[:80]))
    return str(path)


def args(run_model, dataset, out, batch_size, *extra):
    # lr 1e-4: AdamW's first steps move a weight by about lr * g / |g|, so an element whose gradient
    # is almost 0 (cancellation) turns the fp32 rounding of a differently shaped batch into a weight
    # difference that grows with lr: up to 1.6e-6 at lr 1e-3, 2.6e-8 at 1e-4 (the bound below is 1e-6).
    return ["--model", run_model, "--data", dataset, "--out-dir", str(out), "--device", "cpu", "--dtype", "fp32",
            "--no-kernels", "--max-len", "96", "--batch-size", str(batch_size), "--grad-accum", "2",
            "--max-steps", "3", "--warmup-steps", "1", "--lr", "1e-4", "--eval-every", "1", "--eval-batches", "2",
            "--eval-fraction", "0.05", "--save-every", "2", "--gradient-checkpointing", *extra]


def torchrun(argv):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join("tests", "test_ddp.py"), *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    return r.stdout


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def lora(out, step):
    return statefiles.read_state(os.path.join(out, "checkpoints", f"step-{step:07d}"))["lora"]


def test_two_ranks_equal_one_rank_and_resume(run_model, dataset, tmp_path, monkeypatch):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    monkeypatch.setattr(data.Batches, "__next__", masked_next)
    assert train.cli(args(run_model, dataset, one, 4)) == 0
    stdout = torchrun(["--mask", *args(run_model, dataset, two, 2)])
    assert stdout.count("step 3/3 | loss") == 1, "only rank 0 logs"

    (train1, eval1), (train2, eval2) = records(one), records(two)
    assert [r["target_tokens"] for r in train1] == [r["target_tokens"] for r in train2]
    assert train1[0]["target_tokens"] < train1[1]["target_tokens"] / 1.5, "step 1 lost half its rows to the mask"
    for a, b in zip(train1 + eval1, train2 + eval2, strict=True):
        for k in ("loss", "grad_norm", "eval_loss"):
            if k in a:
                assert abs(a[k] - b[k]) <= 1e-6 * abs(a[k]), (k, a, b)
    w1, w2, w2_before = lora(one, 3), lora(two, 3), lora(two, 2)
    for name in w1:
        assert (w1[name] - w2[name]).abs().max() <= 1e-6, name
        assert not torch.equal(w2[name], w2_before[name]), f"step 3 left {name} unchanged: the check means nothing"

    # Resume the 2-rank run from its step-2 checkpoint: the same step 3, bit for bit.
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(two / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    torchrun(["--mask", *args(run_model, dataset, resumed, 2, "--resume", "auto")])
    untimed = lambda r: {k: v for k, v in r.items() if k not in ("tokens_per_s", "peak_rss_gib")}  # noqa: E731
    assert [untimed(r) for r in records(resumed)[0]] == [untimed(train2[-1])]
    w3 = lora(resumed, 3)
    for name in w2:
        assert torch.equal(w3[name], w2[name]), name


if __name__ == "__main__":  # torchrun ... tests/test_ddp.py [--mask] TRAIN-ARGS: one rank of a test run
    argv = sys.argv[1:]
    if argv[0] == "--mask":
        data.Batches.__next__, argv = masked_next, argv[1:]
    sys.exit(train.cli(argv))
