#!/usr/bin/env bash
# GPU check of data parallelism: 50 steps of the TinyLlama-shaped random-init
# model on 1 GPU and on 2 GPUs with torchrun, bf16, packing on, batch 4 x 2048 tokens per GPU.
#   one-b4:  1 GPU, batch 4   (throughput baseline: scaling efficiency = tok/s(two) / (2 x tok/s(one-b4)))
#   one-b8:  1 GPU, batch 8   (the same optimization as 2 GPUs x batch 4: the loss curves must match)
#   two-b4:  2 GPUs, batch 4 each
# Usage: bash scripts/bench/gpu_ddp_runs.sh CHECKPOINT_FOLDER OUT_FOLDER
set -euo pipefail
ckpt=$1; out=$2
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on the lent machines
python3 -c "import sys; sys.path.insert(0, '.'); from tests.tiny_tokenizer import make_test_tokenizer; make_test_tokenizer('$ckpt')"
common=(--model "$ckpt" --dtype bf16 --max-steps 50 --eval-every 0 --save-every 0 --log-every 1 --overwrite)
python3 train.py "${common[@]}" --batch-size 4 --out-dir "$out/one-b4" > "$out/one-b4.log" 2>&1
python3 train.py "${common[@]}" --batch-size 8 --out-dir "$out/one-b8" > "$out/one-b8.log" 2>&1
torchrun --standalone --nproc_per_node=2 train.py "${common[@]}" --batch-size 4 --out-dir "$out/two-b4" > "$out/two-b4.log" 2>&1
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def rows(name):
    return [r for r in map(json.loads, open(f"{out}/{name}/metrics.jsonl")) if "loss" in r and "eval_loss" not in r]
one4, one8, two4 = rows("one-b4"), rows("one-b8"), rows("two-b4")
tps = {n: statistics.median(r["tokens_per_s"] for r in rs[10:]) for n, rs in (("one-b4", one4), ("one-b8", one8), ("two-b4", two4))}
mem = {n: max(r["peak_mem_gib"] for r in rs) for n, rs in (("one-b4", one4), ("one-b8", one8), ("two-b4", two4))}
for n in tps:
    print(f"{n}: median tokens/s steps 11-50 {tps[n]:,.0f}, peak mem (rank 0) {mem[n]:.2f} GiB")
print(f"scaling efficiency (two-b4 / (2 x one-b4)): {tps['two-b4'] / (2 * tps['one-b4']):.3f}")
d = [abs(a["loss"] - b["loss"]) for a, b in zip(one8, two4, strict=True)]
rel = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one8, two4, strict=True)]
print(f"loss one-b8 vs two-b4 over {len(d)} steps: max abs diff {max(d):.2e}, max rel diff {max(rel):.2e}")
print("targets equal every step:", all(a["target_tokens"] == b["target_tokens"] for a, b in zip(one8, two4)))
for s in (0, 9, 24, 49):
    print(f"step {s + 1}: one-b8 loss {one8[s]['loss']:.5f} grad norm {one8[s]['grad_norm']:.4f} | "
          f"two-b4 loss {two4[s]['loss']:.5f} grad norm {two4[s]['grad_norm']:.4f}")
PY
grep -E "eval|batches per epoch" "$out"/*.log || true
