"""Median tok/s of steps 4.. and the peak memory of a train.py run folder's metrics.jsonl."""
import json, statistics, sys
for d in sys.argv[1:]:
    try:
        r = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    except OSError as e:
        print(d, "no metrics", e); continue
    t = [x for x in r if "tokens_per_s" in x]
    k = next((k for k in ("peak_mem_gib", "peak_memory_gib", "peak_gib") if k in t[0]), None) if t else None
    print(d, "steps", len(t), "median tok/s (4..)", round(statistics.median(x["tokens_per_s"] for x in t[3:])) if len(t) > 3 else None,
          "peak", max(x[k] for x in t) if k else None, "step1 peak", t[0].get(k) if k else None)
