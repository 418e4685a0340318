"""Training-step benchmark: nanotune against transformers + PEFT (and Liger Kernel), and
train.py's own loop.

    python scripts/bench/bench.py                     # the table: every shape at its size x all cases,
                                                      # within --time-budget (8 min)
    python scripts/bench/bench.py --shapes tinyllama --ckpt on --out bench.json
    python scripts/bench/bench.py --shapes smollm2-135m                    # at its size, 8 x 512
    python scripts/bench/bench.py --shapes tinyllama --batch 1 --seqlen 64,512
    python scripts/bench/bench.py --shapes smollm2-135m --padded 100-600   # a new length every step
    python scripts/bench/bench.py --train --shapes smollm2-135m            # train.py, packed and --no-packing
    python scripts/bench/bench.py --report bench.json --peers OUT/hf,OUT/unsloth   # beside the peers
    python scripts/bench/bench.py --max-seqlen-probe  # longest TinyLlama sequence at batch 1 (a run of its own)
    python scripts/bench/bench.py --smoke             # tiny shapes, few steps, CPU is fine: every case end to end

Rows are printed as they finish and --out (JSON) is rewritten after each, so a run cut
short still leaves its results. Cases not started when --time-budget runs out are listed
as skipped; a case still running then is killed and listed as timeout.

What is measured. Random-init models with the real architectures (random weights cost
the same FLOPs as trained ones; nothing is downloaded): a transformers config is saved
once with `save_pretrained` in bf16 under --cache-dir, and every case loads that folder,
nanotune through `model.load_model`, transformers through `from_pretrained`. One step is
LoRA (r=16, alpha=16, all 7 projections) forward + backward + AdamW on the LoRA weights,
on a fixed batch of random token ids (labels = ids), bf16. Each case runs in its own
process so that memory statistics and Liger's monkey-patching never leak between
cases. After --warmup steps, each of --steps steps is timed between two
`torch.cuda.synchronize()`; the median is reported. The step, the batches and the timing
are scripts/bench/harness.py's.

Sizes. Each shape has its own batch x seqlen (SmolLM2-135M 8 x 512, the others 4 x 2048);
--batch and --seqlen (a list: one row per length) replace them for every shape. --padded
LO-HI gives every step a new batch instead: each row of random length in [LO, HI],
right-padded to the longest as `train.py --no-packing` pads (the padding a document of its
own, without targets), the same sequence of batches for every case. Its shapes change every
step, so per-shape work (bucketing, one CUDA graph per bucket) is part of what is timed.

  tokens/s   batch * seqlen / median step time; with --padded the real (unpadded) tokens
             of the timed steps / their summed time
  peak mem   torch.cuda.max_memory_allocated over the warm-up and timed steps, reset just
             before the warm-up: it includes the weights, LoRA weights, Adam state,
             activations and the allocator's view of temporaries (not fragmentation).
  MFU        model FLOPs per step / median step time / ceiling, where the ceiling is the
             best bf16 throughput of an 8192^3 matmul measured at the start of the run
             (not given with --padded).

Model FLOPs of one LoRA step (N = batch * seqlen tokens; multiply-add = 2 FLOPs):

  frozen base matmuls  4 * N * P_frozen     forward 2NP + input-gradient 2NP; no weight
                                            gradient, the base is frozen (lm_head included)
  LoRA matmuls         6 * N * P_lora       forward, input-gradient and weight-gradient
  attention            3 * A                A = 4 * B * heads * head_dim * K, the QK^T and PV
                                            matmuls over the K attended (query, key) pairs
                                            per sequence and layer (causal: T(T+1)/2, less
                                            with a sliding window); backward = 2A

Elementwise work (norms, RoPE, softmax, loss) is not counted, nor is the forward pass
that activation checkpointing repeats in backward, nor flash attention's own
recomputation: MFU counts useful work only, so checkpointing lowers it.

Cases. `nanotune`: harness.nanotune_step (`load_model(..., use_kernels=True)`),
checkpointing off / on / on+offload (layer inputs kept in pinned CPU memory); --step-opts
passes keyword arguments to it (dora=true: DoRA adapters, PEFT's in the hf and liger cases).
`nanotune-unfused` (not run unless named in --cases): the
same with `fused_lora=False`, LoRA in plain autograd. `hf`: transformers + PEFT with SDPA
attention; for models with an attention softcap (Gemma 2) also eager attention: the
transformers versions that accept SDPA for Gemma 2 silently drop the softcap (that row then
trains a different model), newer ones refuse it (that row is then skipped). `liger`: the
same with Liger Kernel's `apply_liger_kernel_to_<model_type>()` applied before the model
is built (eager attention where there is a softcap); skipped when `liger_kernel` cannot be
imported, and on CPU. On CPU (--smoke) nanotune runs its pure-torch references, as
Triton needs a GPU.

--max-seqlen-probe: TinyLlama at batch 1 with checkpointing, one step per probe (Adam's
state allocated beforehand), each in its own process; the length doubles from --seqlen
until a step runs out of memory, then is bisected to 1024 tokens. hf goes first, then
nanotune gets what is left of the budget; a search cut short reports its bracket.

--train: train.py's real loop instead of a synthetic step. For every shape, packing mode
(--train-packing) and checkpointing mode (--ckpt, default auto: train.py's own choice), one
`python train.py --model <the shape's checkpoint> --max-steps --steps` on the builtin
dataset, with the tests' tiny tokenizer (tests/tiny_tokenizer.py, no download) written into
the checkpoint folder and --nanotune-opts appended. train.py logs once, at the last step
(--log-every = --max-steps), so its `tokens_per_s` in metrics.jsonl is all the tokens it fed
(padding included, as train.py counts them) over the wall time of the whole loop, warm-up
steps included. No evaluation or checkpoint inside the loop (--eval-every 0 --save-every
0); wall s is the whole process: imports, loading, the loop, the final eval and save.

--peers DIR,...: the JSON results of the peers' harnesses (shared/anchors: hf_baseline.py,
unsloth_bench.py; `--out DIR` there) printed beside nanotune's rows of the same shape,
batch and checkpointing. Their JSON does not record the sequence length: run them at the
same one. --report FILE prints a saved run (and --peers) without running anything.
"""
import argparse
import datetime
import glob
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`, `tests`
from scripts.bench import harness  # noqa: E402
from scripts.bench.harness import CKPT_MODES, LORA_ALPHA, LORA_R, LR, REPO  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = ["nanotune", "hf", "liger", "nanotune-unfused"]
PACKING = ("on", "off")


@dataclass(frozen=True)
class Shape:
    config_class: str  # transformers config class
    sizes: dict  # the real model's config (everything that changes FLOPs or numerics)
    smoke: dict  # overrides for --smoke: a few seconds on CPU, same quirks
    batch: int = 4  # the size this shape is measured at, unless --batch / --seqlen say otherwise
    seqlen: int = 2048


SMOKE_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
SHAPES = {
    "tinyllama": Shape("LlamaConfig", dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=2048,
        tie_word_embeddings=False), SMOKE_SIZES),
    "qwen2.5-0.5b": Shape("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True), SMOKE_SIZES),
    "gemma-2-2b": Shape("Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
        query_pre_attn_scalar=256, max_position_embeddings=8192, tie_word_embeddings=True),
        # window shorter than the smoke sequence, so the sliding mask is exercised
        {**SMOKE_SIZES, "head_dim": 32, "sliding_window": 32, "query_pre_attn_scalar": 32}),
    # a small model at a small batch: the step is bound by the CPU that issues it, not by the GPU
    "smollm2-135m": Shape("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
        {**SMOKE_SIZES, "head_dim": 16}, batch=8, seqlen=512),
}
# Liger's patch function for each transformers model_type (read from config.json).
LIGER_PATCH = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
               "gemma2": "apply_liger_kernel_to_gemma2"}
# The shapes of the peers' harnesses (shared/anchors), by their config letter.
PEER_SHAPES = {"A": "tinyllama", "B": "qwen2.5-0.5b", "C": "gemma-2-2b", "C_eager": "gemma-2-2b", "D": "smollm2-135m"}
# Steps and the matmul size for the ceiling; for --smoke also the size of every shape, the probe's cap and
# granularity, and train.py's rows (--train).
FULL = dict(warmup=3, steps=10, train_steps=60, matmul=8192)
SMOKE = dict(warmup=1, steps=2, train_steps=2, matmul=128, batch=2, seqlen=64, probe_cap=256, probe_step=32,
             train_opts=["--batch-size", "2", "--max-len", "128"])


# ----------------------------------------------------------------------------- FLOPs


def attended_pairs(T, window):
    """(query, key) pairs a causal layer computes for one sequence: sum over t of min(t, window)."""
    if window is None or window >= T:
        return T * (T + 1) // 2
    return window * (window + 1) // 2 + (T - window) * window


def step_flops(hf: dict, batch: int, seqlen: int, r: int = LORA_R) -> int:
    """Useful FLOPs of one LoRA training step for a config.json dict (formula in the module docstring)."""
    H, I, L, V = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    nh = hf["num_attention_heads"]
    nkv = hf.get("num_key_value_heads") or nh
    d = hf.get("head_dim") or H // nh
    # (in, out) of the 7 projections of one layer: q, k, v, o, gate, up, down
    linears = [(H, nh * d), (H, nkv * d), (H, nkv * d), (nh * d, H), (H, I), (H, I), (I, H)]
    p_frozen = L * sum(i * o for i, o in linears) + V * H  # + lm_head (tied or not, it is a matmul)
    p_lora = L * sum(r * (i + o) for i, o in linears)
    types = hf.get("layer_types") or ["full_attention"] * L
    pairs = sum(attended_pairs(seqlen, hf.get("sliding_window") if t == "sliding_attention" else None)
                for t in types)
    attn_fwd = 4 * batch * nh * d * pairs
    N = batch * seqlen
    return 4 * N * p_frozen + 6 * N * p_lora + 3 * attn_fwd


# ----------------------------------------------------------------------------- child processes


def child_device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_checkpoint(shape: str, folder: str, smoke: bool):
    """Save a random-init bf16 checkpoint of `shape` to `folder` (written aside, then renamed)."""
    import shutil

    import torch
    import transformers
    spec = SHAPES[shape]
    cfg = getattr(transformers, spec.config_class)(**{**spec.sizes, **(spec.smoke if smoke else {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = f"{folder}.tmp-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "bench_shape.json"), "w") as f:
        json.dump(shape_key(shape, smoke), f)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)


def shape_key(shape, smoke):
    """What a cached checkpoint was built from; a folder whose key differs is rebuilt."""
    spec = SHAPES[shape]
    return {"config_class": spec.config_class, "sizes": {**spec.sizes, **(spec.smoke if smoke else {})}}


def measure_ceiling(n: int) -> dict:
    """Best bf16 matmul throughput (FLOP/s) over 10 samples of 10 back-to-back n^3 matmuls."""
    import torch
    dev = child_device()
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    samples = []
    for _ in range(10):
        harness.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        harness.synchronize(dev)
        samples.append(10 * 2 * n ** 3 / (time.perf_counter() - t0))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device": dev.type, "device_name": name, "matmul_n": n, "flops_best": max(samples),
            "flops_median": statistics.median(samples)}


class Skip(Exception):
    """A case that cannot run here (not an error of the code under test)."""


def hf_step(case, folder, attn, ckpt, device, dora=False) -> harness.Step:
    """transformers + PEFT (case "hf"), with Liger Kernel's patches first (case "liger"); dora: PEFT's DoRA."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    arch = getattr(transformers, hf["architectures"][0])
    if attn == "sdpa" and not getattr(arch, "_supports_sdpa", True):
        raise Skip(f"transformers {transformers.__version__} refuses sdpa for {arch.__name__}")
    if case == "liger":
        if device.type != "cuda":
            raise Skip("Liger's kernels are Triton: they need a GPU")
        try:
            import liger_kernel.transformers
        except ImportError as e:
            raise Skip(f"import liger_kernel failed: {e}") from e
        getattr(liger_kernel.transformers, LIGER_PATCH[hf["model_type"]])()  # patches classes: before loading
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation=attn, device_map=str(device))
    model.config.use_cache = False
    if ckpt == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, use_dora=dora,
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()

    def loss(b: harness.Batch):
        if b.mask is None:
            loss = model(input_ids=b.input_ids, labels=b.input_ids).loss  # shifts the labels itself
        else:
            labels = b.input_ids.masked_fill(b.mask == 0, -100)  # no loss on padding
            loss = model(input_ids=b.input_ids, attention_mask=b.mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    return harness.Step(model, loss, [p for p in model.parameters() if p.requires_grad], hf["vocab_size"])


def build(case, folder, attn, ckpt, device, step_opts) -> harness.Step:
    if case in ("nanotune", "nanotune-unfused"):
        unfused = {"fused_lora": False} if case == "nanotune-unfused" else {}  # the plain-autograd LoRA reference
        return harness.nanotune_step(folder, device, ckpt, **{**step_opts, **unfused})
    return hf_step(case, folder, attn, ckpt, device, dora=step_opts.get("dora", False))  # the same adapters


def run_case(args) -> dict:
    """Load, then warm-up and timed steps; never raises (OOM and errors become a status)."""
    import torch
    device = child_device()
    cuda = device.type == "cuda"
    res = {"status": "ok", "device": device.type}
    try:
        folder = os.path.join(args.cache_dir, cache_name(args.shape, args.smoke))
        t0 = time.perf_counter()
        (ckpt,) = args.ckpt  # a child runs one mode; --ckpt parses to a list
        step = build(args.case, folder, args.attn, ckpt, device, args.step_opts)
        res["load_s"] = time.perf_counter() - t0
        res["trainable_params"] = sum(p.numel() for p in step.params)
        res["weights_mem_bytes"] = torch.cuda.memory_allocated() if cuda else None
        if args.padded:
            lo, hi = args.padded
            batches = harness.padded_batches(step.vocab_size, lambda rng: [rng.randint(lo, hi)
                                                                           for _ in range(args.batch)], device)
        else:
            (seqlen,) = args.seqlen  # a child runs one size
            batches = repeat(harness.fixed_batch(step.vocab_size, args.batch, seqlen, device))
        if args.warmup == 0:  # the probe: its one step shows the steady-state peak without a second
            step.init_optimizer_state()  # step (minutes, at long sequences)
        res.update(harness.time_steps(step, batches, warmup=args.warmup, steps=args.steps, device=device))
    except torch.OutOfMemoryError as e:
        res.update(status="oom", reason=str(e).split("\n")[0][:300])
    except Skip as e:
        res.update(status="skipped", reason=str(e))
    except Exception as e:
        res.update(status="error", reason=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-3000:])
    if cuda and "peak_mem_bytes" not in res:  # a step failed: the peak up to the failure
        res["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return res


# ----------------------------------------------------------------------------- parent


def cache_name(shape, smoke):
    return f"smoke-{shape}" if smoke else shape


# Children never reach for the hub: the GPU machine has no network.
CHILD_ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def spawn(argv, timeout) -> dict:
    """Run this script as a child with `argv` + --json-out; its JSON, or a status saying why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--json-out", out]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=CHILD_ENV, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": f"killed after {timeout:.0f} s (time budget)"}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {"status": "crashed", "reason": f"exit code {p.returncode}", "traceback": output_tail(p)}


def output_tail(p: subprocess.CompletedProcess) -> str:
    return "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def size_label(row):
    """'B x T' of a row: T is the length, or the padded range, or '?' (peers do not record it)."""
    seqlen = row.get("seqlen")
    return f"{row.get('batch')}x{'?' if seqlen is None else seqlen}"


class Run:
    """The parent: the plan, the deadline, the children, the tables and the JSON."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.time() + args.time_budget
        self.doc = {"meta": {"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
                             "warmup": args.warmup, "steps": args.steps,
                             "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": TARGETS},
                             "optimizer": f"torch.optim.AdamW(lr={LR}, weight_decay=0) on the LoRA weights",
                             "dtype": "bfloat16", "step_opts": args.step_opts, "versions": versions(),
                             "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")},
                             "peak_mem": "max_memory_allocated over warm-up + timed steps (weights included); "
                                         "reset just before the warm-up",
                             "flops": "4*N*P_frozen + 6*N*P_lora + 3*A_fwd; recompute not counted "
                                      "(see scripts/bench/bench.py)"},
                    "results": [], "train": []}

    def left(self):
        return self.deadline - time.time()

    def save(self):
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=2)
        os.replace(tmp, self.args.out)

    def ceiling(self):
        n = SMOKE["matmul"] if self.args.smoke else FULL["matmul"]
        c = spawn(["--ceiling", str(n)], self.left())
        if c.get("status", "ok") != "ok":
            sys.exit(f"error: the matmul ceiling could not be measured ({c.get('reason')}):\n{c.get('traceback', '')}")
        if c["device"] != "cuda" and not self.args.smoke:
            sys.exit("error: no CUDA GPU is visible: the real shapes need one. Use --smoke for the tiny CPU run")
        self.doc["meta"]["ceiling"] = c
        log(f"matmul ceiling: {c['flops_best'] / 1e12:.1f} TFLOP/s bf16 ({c['matmul_n']}^3, best of 10; "
            f"median {c['flops_median'] / 1e12:.1f}) on {c['device_name']}")
        self.save()
        return c

    def checkpoint(self, shape) -> tuple[str | None, str]:
        """(folder, why-not) of the cached checkpoint of `shape`, building it if needed."""
        folder = os.path.join(self.args.cache_dir, cache_name(shape, self.args.smoke))
        marker = os.path.join(folder, "bench_shape.json")
        if os.path.exists(marker):
            with open(marker) as f:
                if json.load(f) == shape_key(shape, self.args.smoke):
                    return folder, ""
        if self.left() <= 0:
            return None, "time budget spent"
        log(f"building the random-init {shape} checkpoint in {folder} ...")
        t0 = time.time()
        argv = (["--make-checkpoint", shape, "--cache-dir", self.args.cache_dir]
                + (["--smoke"] if self.args.smoke else []))
        r = spawn(argv, self.left())
        if r.get("status") != "ok":
            return None, f"checkpoint build {r.get('status')}: {r.get('reason')} {r.get('traceback', '')}"
        log(f"  built in {time.time() - t0:.0f} s")
        return folder, ""

    def sizes(self, shape) -> list[tuple[int, int | None]]:
        """[(batch, seqlen)] of one shape; seqlen None with --padded."""
        a, spec = self.args, SHAPES[shape]
        batch = a.batch or (SMOKE["batch"] if a.smoke else spec.batch)
        if a.padded:
            return [(batch, None)]
        return [(batch, T) for T in (a.seqlen or [SMOKE["seqlen"] if a.smoke else spec.seqlen])]

    def plan(self, shape, hf_config):
        """[(case, attn, ckpt)] for one shape, most important first."""
        softcap = hf_config.get("attn_logit_softcapping") is not None
        rows = []
        for ckpt in self.args.ckpt:
            for case in self.args.cases:
                if ckpt == "on+offload" and case != "nanotune":
                    continue  # transformers has no activation offload to compare with
                attns = {"hf": ["sdpa", "eager"] if softcap else ["sdpa"],
                         "liger": ["eager"] if softcap else ["sdpa"]}.get(case, ["-"])
                rows += [(case, attn, ckpt) for attn in attns]
        return rows

    def case_argv(self, shape, case, attn, ckpt, batch, seqlen, warmup, steps):
        a = self.args
        argv = ["--case", case, "--shape", shape, "--attn", attn, "--ckpt", ckpt, "--batch", str(batch),
                "--warmup", str(warmup), "--steps", str(steps), "--cache-dir", a.cache_dir,
                "--step-opts", ",".join(f"{k}={v}" for k, v in a.step_opts.items())]
        argv += ["--padded", f"{a.padded[0]}-{a.padded[1]}"] if seqlen is None else ["--seqlen", str(seqlen)]
        return argv + (["--smoke"] if a.smoke else [])

    def bench(self):
        a = self.args
        ceiling = self.ceiling()["flops_best"]
        print(TABLE_HEADER, flush=True)
        liger = importlib.util.find_spec("liger_kernel") is not None
        for shape in a.shapes:
            folder, why = self.checkpoint(shape)
            hf = {}
            if folder:
                with open(os.path.join(folder, "config.json")) as f:
                    hf = json.load(f)
            for batch, seqlen in self.sizes(shape):
                flops = step_flops(hf, batch, seqlen) if folder and seqlen else None
                for case, attn, ckpt in (self.plan(shape, hf) if folder else [(c, "-", "-") for c in a.cases]):
                    row = {"shape": shape, "case": case, "attn": attn, "ckpt": ckpt, "batch": batch,
                           "seqlen": seqlen or f"[{a.padded[0]},{a.padded[1]}]", "model_flops_per_step": flops}
                    if not folder:
                        row.update(status="skipped", reason=why)
                    elif case == "liger" and not liger:
                        row.update(status="skipped", reason="liger_kernel is not installed")
                    elif self.left() <= 0:
                        row.update(status="skipped", reason="time budget spent")
                    else:
                        t0 = time.time()
                        row.update(spawn(self.case_argv(shape, case, attn, ckpt, batch, seqlen, a.warmup, a.steps),
                                         self.left()))
                        row["wall_s"] = time.time() - t0  # the whole child: imports, load, compile, steps
                    if row["status"] == "ok" and attn == "sdpa" and hf.get("attn_logit_softcapping") is not None:
                        row["softcap_dropped"] = True
                    if row.get("median_step_s") and flops:
                        row["model_flops_per_s"] = flops / row["median_step_s"]
                        row["mfu"] = row["model_flops_per_s"] / ceiling
                    self.doc["results"].append(row)
                    self.save()
                    print(table_row(row), flush=True)
                    if row["status"] in ("error", "crashed"):
                        log(f"  {row['reason']}\n{row.get('traceback', '')}")
        print_tables(self.doc, a.peers)

    def train(self):
        """train.py's loop on every shape, packing mode and checkpointing mode (see the module docstring)."""
        from tests.tiny_tokenizer import make_test_tokenizer
        a = self.args
        print(TRAIN_HEADER, flush=True)
        for shape in a.shapes:
            folder, why = self.checkpoint(shape)
            if folder and not os.path.exists(os.path.join(folder, "tokenizer.json")):
                make_test_tokenizer(folder)
            for packing in a.train_packing:
                for ckpt in a.ckpt:
                    row = {"shape": shape, "packing": packing, "ckpt": ckpt, "steps": a.steps,
                           "nanotune_opts": a.nanotune_opts}
                    if not folder:
                        row.update(status="skipped", reason=why)
                    elif self.left() <= 0:
                        row.update(status="skipped", reason="time budget spent")
                    else:
                        row.update(self.train_run(shape, folder, packing, ckpt))
                    self.doc["train"].append(row)
                    self.save()
                    print(train_row(row), flush=True)
                    if row["status"] != "ok":
                        log(f"  {row.get('reason')}\n{row.get('traceback', '')}")
        print_tables(self.doc, a.peers)

    def train_run(self, shape, folder, packing, ckpt) -> dict:
        a = self.args
        out_dir = os.path.join(a.cache_dir, "train-runs", f"{cache_name(shape, a.smoke)}-{packing}-{ckpt}")
        cmd = [sys.executable, "train.py", "--model", folder, "--out-dir", out_dir, "--overwrite",
               "--max-steps", str(a.steps), "--log-every", str(a.steps), "--eval-every", "0", "--save-every", "0",
               "--sample-every", "0",
               "--packing" if packing == "on" else "--no-packing"]
        cmd += {"auto": [], "off": ["--no-gradient-checkpointing"], "on": ["--gradient-checkpointing"],
                "on+offload": ["--gradient-checkpointing", "--offload-activations"]}[ckpt]
        cmd += (SMOKE["train_opts"] if a.smoke else []) + shlex.split(a.nanotune_opts)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(self.left(), 1), env=CHILD_ENV,
                               cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": "killed by the time budget", "wall_s": time.time() - t0}
        res = {"wall_s": time.time() - t0, "command": shlex.join(cmd)}
        if p.returncode != 0:
            return {**res, "status": "error", "reason": f"train.py exit code {p.returncode}",
                    "traceback": output_tail(p)}
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if "tokens_per_s" in r]
        if len(records) != 1 or records[0]["step"] != a.steps:
            return {**res, "status": "error", "reason": f"expected one train record, at step {a.steps} "
                    f"(--log-every {a.steps}); metrics.jsonl has steps {[r['step'] for r in records]}"}
        r = records[0]
        return {**res, "status": "ok", "tokens_per_s": r["tokens_per_s"], "loss_final": r["loss"],
                "peak_mem_bytes": r.get("peak_mem_gib", 0) * 2**30 or None}  # no GPU: none

    def probe(self):
        """Longest sequence (batch 1, checkpointing on) that trains without OOM, per implementation."""
        a = self.args
        shape = "tinyllama"
        cap, step = (SMOKE["probe_cap"], SMOKE["probe_step"]) if a.smoke else (a.probe_cap, 1024)
        start = (a.seqlen or [SMOKE["seqlen"] if a.smoke else SHAPES[shape].seqlen])[0]
        self.ceiling()
        folder, why = self.checkpoint(shape)
        if not folder:
            sys.exit(f"error: no {shape} checkpoint: {why}")
        targets = [c for c in ("hf", "nanotune") if c in a.cases]  # hf first: it stops sooner, nanotune gets the rest
        out = self.doc["max_seqlen"] = {"shape": shape, "batch": 1, "ckpt": "on", "start": start, "cap": cap,
                                        "granularity": step, "results": {}}
        for i, case in enumerate(targets):
            deadline = time.time() + self.left() / (len(targets) - i)
            probes = []

            def fits(T, case=case, deadline=deadline, probes=probes):
                if time.time() >= deadline:
                    return None
                r = spawn(self.case_argv(shape, case, "sdpa" if case == "hf" else "-", "on", 1, T, 0, 1),
                          deadline - time.time())
                probes.append({"seqlen": T, **{k: r.get(k) for k in ("status", "reason", "median_step_s",
                                                                   "peak_mem_bytes", "peak_reserved_bytes")}})
                log(f"  {case} seqlen {T}: {r['status']}" + (f" ({r.get('reason')})" if r["status"] != "ok" else "")
                    + (f", peak {r['peak_mem_bytes'] / 2**30:.1f} GiB" if r.get("peak_mem_bytes") else ""))
                return {"ok": True, "oom": False, "error": False, "crashed": False}.get(r["status"])

            res = longest_fitting(fits, start, cap, step)
            failed = [p for p in probes if p["seqlen"] == res["first_fail"]]
            res["first_fail_status"] = failed[-1]["status"] if failed else None  # "oom", or an error to read
            res["first_fail_reason"] = failed[-1]["reason"] if failed else None
            res["probes"] = probes
            out["results"][case] = res
            self.save()
            print(probe_line(case, res), flush=True)


def longest_fitting(fits, start, cap, step):
    """Double from `start` until `fits(T)` is False, then bisect to `step` tokens.

    fits(T) -> True, False, or None (no answer: out of time). Returns max_fit (0 if even
    `start` fails), first_fail (None if `cap` fits) and `stopped` (why the search ended).
    """
    lo, hi, T = 0, None, start
    while True:
        ok = fits(T)
        if ok is None:
            return {"max_fit": lo, "first_fail": hi, "stopped": "time budget"}
        if not ok:
            hi = T
            break
        lo = T
        if T >= cap:
            return {"max_fit": lo, "first_fail": None, "stopped": "cap"}
        T = min(2 * T, cap)
    while hi - lo > step:
        mid = max((lo + hi) // 2 // step * step, lo + step)
        ok = fits(mid)
        if ok is None:
            return {"max_fit": lo, "first_fail": hi, "stopped": "time budget"}
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {"max_fit": lo, "first_fail": hi, "stopped": "converged"}


def probe_line(case, r):
    if r["stopped"] == "cap":
        return f"{case}: fits {r['max_fit']} tokens (the cap; longer not tried)"
    bound = f"fails at {r['first_fail']}" if r["first_fail"] else "no failure seen"
    if r["first_fail"] and r["first_fail_status"] != "oom":
        bound += f" with {r['first_fail_status']}, not OOM: {r['first_fail_reason']}"
    note = " (stopped by the time budget: a bracket, not the exact limit)" if r["stopped"] == "time budget" else ""
    return f"{case}: longest that fits {r['max_fit']} tokens, {bound}{note}"


# ----------------------------------------------------------------------------- tables


def fmt(r, key, spec, scale=1.0):
    return format(r[key] * scale, spec) if r.get(key) is not None else ""


def status_text(r):
    return r["status"] if r["status"] in ("ok", "oom") else f"{r['status']}: {str(r.get('reason', ''))[:60]}"


TABLE_HEADER = ("| shape | B x T | case | attn | ckpt | status | step ms | tokens/s | TFLOP/s | MFU | peak GiB "
                "| loss first→final |\n|---|---|---|---|---|---|---:|---:|---:|---:|---:|---|")


def table_row(r):
    loss = f"{r['loss_first']:.3f}→{r['loss_final']:.3f}" if r.get("loss_final") is not None else ""
    return (f"| {r['shape']} | {size_label(r)} | {r['case']} | {r['attn']} | {r['ckpt']} | {status_text(r)} | "
            f"{fmt(r, 'median_step_s', '.1f', 1e3)} | {fmt(r, 'tokens_per_s', ',.0f')} | "
            f"{fmt(r, 'model_flops_per_s', '.1f', 1e-12)} | {fmt(r, 'mfu', '.1%')} | "
            f"{fmt(r, 'peak_mem_bytes', '.2f', 2 ** -30)} | {loss} |")


TRAIN_HEADER = ("| shape | packing | ckpt | steps | status | tokens/s (all steps) | wall s | peak GiB | final loss |\n"
                "|---|---|---|---:|---|---:|---:|---:|---:|")


def train_row(r):
    return (f"| {r['shape']} | {r['packing']} | {r['ckpt']} | {r['steps']} | {status_text(r)} | "
            f"{fmt(r, 'tokens_per_s', ',.0f')} | {fmt(r, 'wall_s', '.0f')} | "
            f"{fmt(r, 'peak_mem_bytes', '.2f', 2 ** -30)} | {fmt(r, 'loss_final', '.3f')} |")


def peer_rows(folder) -> list[dict]:
    """The rows of every results JSON of a peers' harness in `folder`, in this script's row format."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            continue  # not a results file
        unsloth = "unsloth" in os.path.basename(path).lower()
        for r in doc["rows"]:
            case = "unsloth" if unsloth or "unsloth_version" in r else "hf+liger" if r.get("liger") else "hf"
            rows.append({"shape": PEER_SHAPES.get(r.get("config"), r.get("name")), "case": case,
                         "attn": r.get("attn", "-"), "ckpt": "on" if r.get("ckpt") else "off", "batch": r.get("batch"),
                         "status": "ok" if r.get("status") == "ok" else "error", "reason": r.get("status"),
                         "median_step_s": r.get("step_s_median"), "tokens_per_s": r.get("tokens_per_s"),
                         "peak_mem_bytes": r["peak_gib"] * 2**30 if r.get("peak_gib") else None, "source": path})
    return rows


PEERS_HEADER = ("| shape | B | ckpt | peer | attn | status | peer tok/s | peer peak GiB | nanotune B x T "
                "| nanotune tok/s | nanotune peak GiB | nanotune / peer |\n"
                "|---|---:|---|---|---|---|---:|---:|---|---:|---:|---:|")


def peers_table(results, peers) -> list[str]:
    """One line per peer row and nanotune row (case nanotune, status ok) of the same shape, batch and
    checkpointing (a peer without a nanotune match gets one line with the nanotune columns empty)."""
    lines = []
    for p in peers:
        ours = [r for r in results if r["case"] == "nanotune" and r["status"] == "ok" and r["shape"] == p["shape"]
                and r["batch"] == p["batch"] and r["ckpt"] == p["ckpt"]] or [{}]
        for r in ours:
            ratio = (f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" if r.get("tokens_per_s") and p.get("tokens_per_s")
                     else "")
            lines.append(f"| {p['shape']} | {p['batch']} | {p['ckpt']} | {p['case']} | {p['attn']} | "
                         f"{p['status'] if p['status'] == 'ok' else p['reason']} | {fmt(p, 'tokens_per_s', ',.0f')} | "
                         f"{fmt(p, 'peak_mem_bytes', '.2f', 2 ** -30)} | {size_label(r) if r else ''} | "
                         f"{fmt(r, 'tokens_per_s', ',.0f')} | {fmt(r, 'peak_mem_bytes', '.2f', 2 ** -30)} | {ratio} |")
    return lines


def print_tables(doc, peer_folders):
    """The summary of a run (or of a saved one): its tables, then the peers beside nanotune."""
    results, train = doc.get("results", []), doc.get("train", [])
    if results:
        print("\n" + TABLE_HEADER)
        for row in results:
            print(table_row(row))
        ceiling = doc["meta"].get("ceiling")
        if ceiling:
            print(f"\nMFU against {ceiling['flops_best'] / 1e12:.1f} TFLOP/s ({ceiling['device_name']}); "
                  "peak GiB includes the weights.")
        dropped = sorted({r["shape"] for r in results if r.get("softcap_dropped")})
        if dropped:
            print(f"{', '.join(dropped)} with sdpa: this transformers drops the attention softcap, so those rows "
                  "train a different (cheaper) model than nanotune and eager do.")
    if train:
        print("\n" + TRAIN_HEADER)
        for row in train:
            print(train_row(row))
        print("\ntokens/s: train.py's own count (padding included) over its whole loop, warm-up steps included.")
    peers = [p for folder in peer_folders for p in peer_rows(folder)]
    if peer_folders:
        print("\n" + PEERS_HEADER)
        print("\n".join(peers_table(results, peers)) if peers else "(no peer results found)")
        print("\nThe peers' JSON does not record the sequence length: compare rows run at the same length.")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- command line


def versions():
    v = {"python": sys.version.split()[0]}
    for pkg in ("torch", "triton", "transformers", "peft", "liger-kernel", "safetensors"):
        try:
            v[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            v[pkg] = None
    return v


def csv(choices):
    def parse(s):
        items = [x for x in s.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; choose from {','.join(choices)}")
        return items
    return parse


def positive_ints(s):
    try:
        items = [int(x) for x in s.split(",") if x]
    except ValueError:
        items = []
    if not items or min(items) <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive whole numbers, comma-separated")
    return items


def length_range(s):
    lo, _, hi = s.partition("-")
    try:
        lo, hi = int(lo), int(hi)
    except ValueError:
        lo = hi = 0
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"{s!r}: expected LO-HI with 0 < LO <= HI, e.g. 100-600")
    return lo, hi


def step_options(s):
    """'key=value,...' -> keyword arguments of harness.nanotune_step (true/false, numbers, or text)."""
    allowed = [n for n, p in inspect.signature(harness.nanotune_step).parameters.items() if p.kind == p.KEYWORD_ONLY]
    opts = {}
    for item in (x for x in s.split(",") if x):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise argparse.ArgumentTypeError(f"{item!r}: expected key=value with key one of {', '.join(allowed)}")
        opts[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(opts[key], str):
            try:
                opts[key] = float(value) if "." in value else int(value)
            except ValueError:
                pass
    return opts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true",
                      help="instead of the table: time train.py's own loop (see --train-packing, --nanotune-opts)")
    mode.add_argument("--max-seqlen-probe", action="store_true",
                      help="instead of the table: the longest TinyLlama sequence that fits at batch 1 with "
                           "checkpointing, for nanotune and hf (double until OOM, then bisect to 1024 tokens)")
    mode.add_argument("--report", metavar="FILE", help="print the tables of a saved run (its --out JSON) and "
                      "of --peers; runs nothing")
    p.add_argument("--shapes", type=csv(list(SHAPES)), default=list(SHAPES), help="comma-separated, run in this order")
    p.add_argument("--cases", type=csv(CASES), default=["nanotune", "hf", "liger"],
                   help="implementations, run in this order within a shape and checkpointing mode "
                        "(nanotune-unfused: load_model(fused_lora=False), LoRA in plain autograd)")
    p.add_argument("--ckpt", type=csv([*CKPT_MODES, "auto"]),
                   help="activation checkpointing modes (on+offload: nanotune only); default on,off,on+offload. "
                        "With --train also auto (no flag: train.py decides by the free memory), the default")
    p.add_argument("--steps", type=int, help="timed steps; the median is reported (default 10; --smoke: 2). "
                   "With --train: train.py's --max-steps, all of them timed (default 60; --smoke: 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first: Triton compiles, the allocator warms up "
                   "(default 3; --smoke: 1)")
    p.add_argument("--batch", type=int, help="sequences per step, for every shape (default: the shape's own, "
                   "8 for smollm2-135m, else 4; --smoke: 2)")
    p.add_argument("--seqlen", type=positive_ints, help="tokens per sequence, comma-separated for several rows, "
                   "for every shape (default: the shape's own, 512 for smollm2-135m, else 2048; --smoke: 64); "
                   "the probe starts at the first")
    p.add_argument("--padded", type=length_range, metavar="LO-HI",
                   help="instead of --seqlen: a new batch every step, each row of random length in [LO, HI], "
                        "right-padded to the longest; tokens/s counts the real tokens")
    p.add_argument("--step-opts", type=step_options, default={}, metavar="KEY=VALUE,...",
                   help="keyword arguments of scripts/bench/harness.py's nanotune_step for the nanotune cases, "
                        "e.g. use_kernels=false")
    p.add_argument("--train-packing", type=csv(list(PACKING)), default=list(PACKING),
                   help="--train: packed rows (on), one example per padded row (off), or both")
    p.add_argument("--nanotune-opts", default="", metavar="'OPTIONS'",
                   help="--train: more train.py options, appended to its command line, e.g. '--batch-size 8'")
    p.add_argument("--peers", type=lambda s: [x for x in s.split(",") if x], default=[], metavar="DIR,...",
                   help="output folders of the peers' harnesses (shared/anchors): print their rows beside nanotune's")
    p.add_argument("--probe-cap", type=int, default=262144, help="the probe never tries longer sequences")
    p.add_argument("--time-budget", type=float, default=480, help="seconds; cases not started by then are "
                   "reported as skipped, a running one is killed (the default fits a 10-minute limit)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few steps (CPU is fine): checks every case runs")
    p.add_argument("--out", help="JSON results, rewritten after every case (default: <cache-dir>/bench.json, "
                   "train.json with --train, probe.json with --max-seqlen-probe)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "nanotune-bench"),
                   help="random-init checkpoints, built once per shape, and the --train run folders")
    # internal: one child process
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--attn", default="-", help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", choices=list(SHAPES), metavar="SHAPE",
                   help="only write SHAPE's random-init checkpoint to <cache-dir>/SHAPE (for train.py --model)")
    p.add_argument("--ceiling", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = SMOKE if args.smoke else FULL
    if args.warmup is None:
        args.warmup = defaults["warmup"]
    if args.steps is None:
        args.steps = defaults["train_steps" if args.train else "steps"]
    if args.ckpt is None:
        args.ckpt = ["auto"] if args.train else list(CKPT_MODES)
    if "auto" in args.ckpt and not args.train:
        p.error("--ckpt auto is train.py's own choice: it needs --train")
    for name in ("steps", "batch", "probe_cap"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.padded and (args.seqlen or args.max_seqlen_probe or args.train):
        p.error("--padded sets the lengths itself: drop --seqlen, --max-seqlen-probe and --train")
    if args.train and (args.batch or args.seqlen):
        p.error("--train runs train.py at its own --batch-size and --max-len: pass them in --nanotune-opts")
    if args.nanotune_opts and not args.train:
        p.error("--nanotune-opts goes to train.py: it needs --train (the table's step takes --step-opts)")
    return args


def main():
    args = parse_args()
    if args.json_out or args.make_checkpoint:  # a child: do one thing, write its JSON (or say what failed)
        try:
            if args.ceiling:
                res = measure_ceiling(args.ceiling)
            elif args.make_checkpoint:
                make_checkpoint(args.make_checkpoint, os.path.join(args.cache_dir, cache_name(args.make_checkpoint,
                                args.smoke)), args.smoke)
                res = {"status": "ok"}
            else:
                res = run_case(args)
        except Exception as e:
            res = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500],
                   "traceback": traceback.format_exc()[-3000:]}
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(res, f)
        elif res["status"] != "ok":
            sys.exit(f"error: {res['reason']}")
        return
    if args.report:
        with open(args.report) as f:
            print_tables(json.load(f), args.peers)
        return
    for folder in args.peers:  # before the run: a typo must not wait until its end
        if not os.path.isdir(folder):
            sys.exit(f"error: --peers {folder}: no such folder (the --out folder of a peers' harness)")
    os.makedirs(args.cache_dir, exist_ok=True)
    if args.out is None:
        name = "probe.json" if args.max_seqlen_probe else "train.json" if args.train else "bench.json"
        args.out = os.path.join(args.cache_dir, name)
    run = Run(args)
    if args.max_seqlen_probe:
        run.probe()
    elif args.train:
        run.train()
    else:
        run.bench()
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
