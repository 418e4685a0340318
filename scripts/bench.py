"""Training-step benchmark: nanotune against transformers + PEFT (and Liger Kernel).

    python scripts/bench.py                          # the table: 3 shapes x all cases, within --time-budget (8 min)
    python scripts/bench.py --shapes tinyllama --ckpt on --out bench.json
    python scripts/bench.py --max-seqlen-probe       # longest TinyLlama sequence at batch 1 (a run of its own)
    python scripts/bench.py --smoke                  # tiny shapes, 2 steps, CPU is fine: every case end to end

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
`torch.cuda.synchronize()`; the median is reported.

  tokens/s   batch * seqlen / median step time
  peak mem   torch.cuda.max_memory_allocated over the warm-up and timed steps, reset just
             before the warm-up: it includes the weights, LoRA weights, Adam state,
             activations and the allocator's view of temporaries (not fragmentation).
  MFU        model FLOPs per step / median step time / ceiling, where the ceiling is the
             best bf16 throughput of an 8192^3 matmul measured at the start of the run.

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

Cases. `nanotune`: `load_model(..., use_kernels=True)`, checkpointing off / on /
on+offload (layer inputs kept in pinned CPU memory). `nanotune-unfused` (not run unless
named in --cases): the same with `fused_lora=False`, LoRA in plain autograd. `hf`: transformers + PEFT with SDPA
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
"""
import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_R, LORA_ALPHA, LR = 16, 16, 2e-4  # LoRA as in train.py's defaults
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = ["nanotune", "hf", "liger", "nanotune-unfused"]
CKPT_MODES = ("on", "off", "on+offload")  # on first: it is what train.py uses by default


@dataclass(frozen=True)
class Shape:
    config_class: str  # transformers config class
    sizes: dict  # the real model's config (everything that changes FLOPs or numerics)
    smoke: dict  # overrides for --smoke: a few seconds on CPU, same quirks


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
}
# Liger's patch function for each transformers model_type (read from config.json).
LIGER_PATCH = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
               "gemma2": "apply_liger_kernel_to_gemma2"}
# The default run, and --smoke: batch, seqlen, warm-up and timed steps, matmul size for the ceiling, probe cap and granularity.
FULL = dict(batch=4, seqlen=2048, warmup=3, steps=10)
SMOKE = dict(batch=2, seqlen=64, warmup=1, steps=2, matmul=512, probe_cap=256, probe_step=32)


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
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    samples = []
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        samples.append(10 * 2 * n ** 3 / (time.perf_counter() - t0))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device": dev.type, "device_name": name, "matmul_n": n, "flops_best": max(samples),
            "flops_median": statistics.median(samples)}


class Skip(Exception):
    """A case that cannot run here (not an error of the code under test)."""


def build(case, folder, attn, ckpt, device):
    """(model, trainable params, loss function of (ids, targets)) for one case."""
    import torch
    if case in ("nanotune", "nanotune-unfused"):
        sys.path.insert(0, REPO)
        from model import LoRAConfig, load_model
        # Triton needs a GPU; on CPU (--smoke) the model runs its pure-torch references.
        unfused = {"fused_lora": False} if case == "nanotune-unfused" else {}  # the plain-autograd LoRA reference
        model, _ = load_model(folder, dtype=torch.bfloat16, device=device, lora=LoRAConfig(r=LORA_R, alpha=LORA_ALPHA),
                              use_kernels=device.type == "cuda", **unfused)
        model.gradient_checkpointing = ckpt != "off"
        model.offload_activations = ckpt == "on+offload"
        loss_fn = lambda ids, targets: model(ids, targets=targets)
    else:
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
        model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                 target_modules=TARGETS, task_type="CAUSAL_LM"))
        loss_fn = lambda ids, targets: model(input_ids=ids, labels=ids).loss  # shifts the labels itself
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad], loss_fn


def run_case(args) -> dict:
    """Load, then warm-up and timed steps; never raises (OOM and errors become a status)."""
    import torch
    device = child_device()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {"status": "ok", "device": device.type}
    try:
        folder = os.path.join(args.cache_dir, cache_name(args.shape, args.smoke))
        t0 = time.perf_counter()
        (ckpt,) = args.ckpt  # a child runs one mode; --ckpt parses to a list
        model, params, loss_fn = build(args.case, folder, args.attn, ckpt, device)
        res["load_s"] = time.perf_counter() - t0
        if args.case.startswith("nanotune"):
            res["use_kernels"] = cuda
        res["trainable_params"] = sum(p.numel() for p in params)
        res["weights_mem_bytes"] = torch.cuda.memory_allocated() if cuda else None
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        with open(os.path.join(folder, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (args.batch, args.seqlen), generator=gen).to(device)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]  # nanotune takes targets already shifted; transformers shifts labels=ids
        if args.warmup == 0:  # the probe: allocate Adam's moments now, so that its one step shows the
            for p in params:  # steady-state peak without a second step (minutes, at long sequences)
                p.grad = torch.zeros_like(p)
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt.param_groups[0]["lr"] = LR
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, times = [], []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            loss = loss_fn(ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        res.update(step_times_s=times, median_step_s=statistics.median(times), loss_first=losses[0],
                   loss_final=losses[-1])
    except torch.OutOfMemoryError as e:
        res.update(status="oom", reason=str(e).split("\n")[0][:300])
    except Skip as e:
        res.update(status="skipped", reason=str(e))
    except Exception as e:
        res.update(status="error", reason=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-3000:])
    if cuda:
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
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        return {"status": "crashed", "reason": f"exit code {p.returncode}", "traceback": tail}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Run:
    """The parent: the plan, the deadline, the children, the table and the JSON."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.time() + args.time_budget
        self.doc = {"meta": {"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
                             "batch": args.batch, "seqlen": args.seqlen, "warmup": args.warmup, "steps": args.steps,
                             "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": TARGETS},
                             "optimizer": f"torch.optim.AdamW(lr={LR}, weight_decay=0) on the LoRA weights",
                             "dtype": "bfloat16", "versions": versions(),
                             "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")},
                             "peak_mem": "max_memory_allocated over warm-up + timed steps (weights included); "
                                         "reset just before the warm-up",
                             "flops": "4*N*P_frozen + 6*N*P_lora + 3*A_fwd; recompute not counted (see scripts/bench.py)"},
                    "results": []}

    def left(self):
        return self.deadline - time.time()

    def save(self):
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=2)
        os.replace(tmp, self.args.out)

    def ceiling(self):
        n = SMOKE["matmul"] if self.args.smoke else 8192
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
        argv = ["--make-checkpoint", shape, "--cache-dir", self.args.cache_dir] + (["--smoke"] if self.args.smoke else [])
        r = spawn(argv, self.left())
        if r.get("status") != "ok":
            return None, f"checkpoint build {r.get('status')}: {r.get('reason')} {r.get('traceback', '')}"
        log(f"  built in {time.time() - t0:.0f} s")
        return folder, ""

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
        argv = ["--case", case, "--shape", shape, "--attn", attn, "--ckpt", ckpt, "--batch", str(batch),
                "--seqlen", str(seqlen), "--warmup", str(warmup), "--steps", str(steps),
                "--cache-dir", self.args.cache_dir]
        return argv + (["--smoke"] if self.args.smoke else [])

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
            flops = step_flops(hf, a.batch, a.seqlen) if folder else None
            for case, attn, ckpt in (self.plan(shape, hf) if folder else [(c, "-", "-") for c in a.cases]):
                row = {"shape": shape, "case": case, "attn": attn, "ckpt": ckpt, "batch": a.batch, "seqlen": a.seqlen,
                       "model_flops_per_step": flops}
                if not folder:
                    row.update(status="skipped", reason=why)
                elif case == "liger" and not liger:
                    row.update(status="skipped", reason="liger_kernel is not installed")
                elif self.left() <= 0:
                    row.update(status="skipped", reason="time budget spent")
                else:
                    t0 = time.time()
                    row.update(spawn(self.case_argv(shape, case, attn, ckpt, a.batch, a.seqlen, a.warmup, a.steps),
                                     self.left()))
                    row["wall_s"] = time.time() - t0  # the whole child: imports, load, compile, steps
                if row["status"] == "ok" and attn == "sdpa" and hf.get("attn_logit_softcapping") is not None:
                    row["softcap_dropped"] = True
                if row.get("median_step_s"):
                    row["tokens_per_s"] = a.batch * a.seqlen / row["median_step_s"]
                    row["model_flops_per_s"] = flops / row["median_step_s"]
                    row["mfu"] = row["model_flops_per_s"] / ceiling
                self.doc["results"].append(row)
                self.save()
                print(table_row(row), flush=True)
                if row["status"] in ("error", "crashed"):
                    log(f"  {row['reason']}\n{row.get('traceback', '')}")
        print("\n" + TABLE_HEADER)
        for row in self.doc["results"]:
            print(table_row(row))
        print(f"\nMFU against {ceiling / 1e12:.1f} TFLOP/s ({self.doc['meta']['ceiling']['device_name']}); "
              "peak GiB includes the weights.", flush=True)
        dropped = sorted({r["shape"] for r in self.doc["results"] if r.get("softcap_dropped")})
        if dropped:
            print(f"{', '.join(dropped)} with sdpa: this transformers drops the attention softcap, so those rows "
                  "train a different (cheaper) model than nanotune and eager do.", flush=True)

    def probe(self):
        """Longest sequence (batch 1, checkpointing on) that trains without OOM, per implementation."""
        a = self.args
        shape = "tinyllama"
        cap, step = (SMOKE["probe_cap"], SMOKE["probe_step"]) if a.smoke else (a.probe_cap, 1024)
        self.ceiling()
        folder, why = self.checkpoint(shape)
        if not folder:
            sys.exit(f"error: no {shape} checkpoint: {why}")
        targets = [c for c in ("hf", "nanotune") if c in a.cases]  # hf first: it stops sooner, nanotune gets the rest
        out = self.doc["max_seqlen"] = {"shape": shape, "batch": 1, "ckpt": "on", "start": a.seqlen, "cap": cap,
                                        "granularity": step, "results": {}}
        for i, case in enumerate(targets):
            deadline = time.time() + self.left() / (len(targets) - i)
            probes = []

            def fits(T):
                if time.time() >= deadline:
                    return None
                r = spawn(self.case_argv(shape, case, "sdpa" if case == "hf" else "-", "on", 1, T, 0, 1),
                          deadline - time.time())
                probes.append({"seqlen": T, **{k: r.get(k) for k in ("status", "reason", "median_step_s",
                                                                   "peak_mem_bytes", "peak_reserved_bytes")}})
                log(f"  {case} seqlen {T}: {r['status']}" + (f" ({r.get('reason')})" if r["status"] != "ok" else "")
                    + (f", peak {r['peak_mem_bytes'] / 2**30:.1f} GiB" if r.get("peak_mem_bytes") else ""))
                return {"ok": True, "oom": False, "error": False, "crashed": False}.get(r["status"])

            res = longest_fitting(fits, a.seqlen, cap, step)
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


TABLE_HEADER = ("| shape | case | attn | ckpt | status | step ms | tokens/s | TFLOP/s | MFU | peak GiB | loss first→final |\n"
                "|---|---|---|---|---|---:|---:|---:|---:|---:|---|")


def table_row(r):
    def f(key, fmt, scale=1.0):
        return format(r[key] * scale, fmt) if r.get(key) is not None else ""
    status = r["status"] if r["status"] in ("ok", "oom") else f"{r['status']}: {str(r.get('reason', ''))[:60]}"
    loss = f"{r['loss_first']:.3f}→{r['loss_final']:.3f}" if r.get("loss_final") is not None else ""
    return (f"| {r['shape']} | {r['case']} | {r['attn']} | {r['ckpt']} | {status} | {f('median_step_s', '.1f', 1e3)} | "
            f"{f('tokens_per_s', ',.0f')} | {f('model_flops_per_s', '.1f', 1e-12)} | {f('mfu', '.1%')} | "
            f"{f('peak_mem_bytes', '.2f', 2 ** -30)} | {loss} |")


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=csv(list(SHAPES)), default=list(SHAPES), help="comma-separated, run in this order")
    p.add_argument("--cases", type=csv(CASES), default=["nanotune", "hf", "liger"],
                   help="implementations, run in this order within a shape and checkpointing mode "
                        "(nanotune-unfused: load_model(fused_lora=False), LoRA in plain autograd)")
    p.add_argument("--ckpt", type=csv(list(CKPT_MODES)), default=list(CKPT_MODES),
                   help="activation checkpointing modes (on+offload: nanotune only)")
    p.add_argument("--steps", type=int, help="timed steps; the median is reported (default 10; --smoke: 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first: Triton compiles, the allocator warms up "
                   "(default 3; --smoke: 1)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; --smoke: 2)")
    p.add_argument("--seqlen", type=int, help="tokens per sequence; the probe starts here (default 2048; --smoke: 64)")
    p.add_argument("--max-seqlen-probe", action="store_true",
                   help="instead of the table: the longest TinyLlama sequence that fits at batch 1 with "
                        "checkpointing, for nanotune and hf (double until OOM, then bisect to 1024 tokens)")
    p.add_argument("--probe-cap", type=int, default=262144, help="the probe never tries longer sequences")
    p.add_argument("--time-budget", type=float, default=480, help="seconds; cases not started by then are "
                   "reported as skipped, a running one is killed (the default fits a 10-minute limit)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps (CPU is fine): checks every case runs")
    p.add_argument("--out", help="JSON results, rewritten after every case (default: <cache-dir>/bench.json, "
                   "or probe.json with --max-seqlen-probe)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "nanotune-bench"),
                   help="random-init checkpoints, built once per shape")
    # internal: one child process
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--attn", default="-", help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--ceiling", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, default in FULL.items():
        if getattr(args, name) is None:
            setattr(args, name, SMOKE[name] if args.smoke else default)
    for name in ("steps", "batch", "seqlen", "probe_cap"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main():
    args = parse_args()
    if args.json_out:  # a child: do one thing, write its JSON
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
            res = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
        with open(args.json_out, "w") as f:
            json.dump(res, f)
        return
    os.makedirs(args.cache_dir, exist_ok=True)
    if args.out is None:
        args.out = os.path.join(args.cache_dir, "probe.json" if args.max_seqlen_probe else "bench.json")
    run = Run(args)
    if args.max_seqlen_probe:
        run.probe()
    else:
        run.bench()
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
