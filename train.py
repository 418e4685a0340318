"""nanotune: LoRA / QLoRA fine-tuning of Llama, Qwen and Gemma in one readable loop.

    python train.py --model tinyllama                     # the embedded dataset, defaults for the hardware
    python train.py --model ./my-model --data chats.jsonl --max-steps 500
    torchrun --nproc_per_node=2 train.py --model tinyllama  # data-parallel on 2 GPUs

The loop, top to bottom: set the lr -> checkpoint / evaluate -> micro-steps (forward,
backward) -> unscale, clip, step, zero_grad -> log. Ctrl-C finishes the step, checkpoints
and exits; `--resume auto` then continues exactly (weights, optimizer, loss scale, data
position, RNG). Bad input fails before the weights load, with one line that says the fix.

Loss normalization: the loss of an optimizer step is Σ token losses over all its
micro-batches (and all ranks) / Σ target tokens over all of them. The count is taken
before the micro-steps and passed into the loss, so a micro-batch weighs by its tokens,
whatever the padding or packing.
"""
import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import data
from model import LoRAConfig, load_model, load_tokenizer
from model.adapters import save_adapter
from model.config import from_hf_config
from model.load import read_hf_config, resolve
from model.lora import ALL_TARGETS, lora_parameters


@dataclass
class TrainConfig:
    # --- model ---
    model: str = field(default="tinyllama", metadata={"help": "short name, hub repo id, local folder or .gguf file"})
    quantize: str | None = field(default=None, metadata={"help": "'nf4' for QLoRA (4-bit frozen base, needs bitsandbytes)"})
    # --- LoRA ---
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; 16 is a common quality/size balance"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scale numerator: the update is scaled by alpha / r"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input (0 keeps the fused path fastest)"})
    lora_targets: str = field(default=",".join(ALL_TARGETS), metadata={"help": "comma-separated projections that get adapters"})
    rslora: bool = field(default=False, metadata={"help": "rank-stabilized LoRA: scale alpha / sqrt(r)"})
    # --- data ---
    data: str = field(default="builtin", metadata={"help": "'builtin', a .jsonl/.json file, or user/repo:path.jsonl on the hub"})
    max_len: int = field(default=2048, metadata={"help": "tokens per row (packed) or longest example (padded)"})
    packing: bool = field(default=True, metadata={"help": "pack examples into full rows (per-document attention and positions)"})
    train_on_inputs: bool = field(default=False, metadata={"help": "also train on prompt tokens, not only answers"})
    eval_fraction: float = field(default=0.02, metadata={"help": "share of a user dataset held out for eval (builtin has its own split)"})
    # --- optimization ---
    batch_size: int = field(default=4, metadata={"help": "rows per micro-batch (per GPU)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (typical for LoRA)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the cosine decays to lr * this"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warm-up steps before the cosine"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the LoRA weights"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global grad norm to this (0: off)"})
    seed: int = field(default=1337, metadata={"help": "seed for LoRA init, data order and dropout"})
    # --- precision and memory ---
    dtype: str = field(default="auto", metadata={"help": "auto | bf16 | fp16 | fp32 (auto: bf16 if supported, else fp16 on GPU, fp32 on CPU)"})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "recompute each decoder layer in backward"})
    offload_activations: bool = field(default=False, metadata={"help": "with checkpointing: keep layer inputs in pinned CPU memory"})
    kernels: bool | None = field(default=None, metadata={"help": "Triton kernels (default: on with CUDA); --no-kernels runs the torch references"})
    loss_scale: float = field(default=2.0 ** 16, metadata={"help": "fp16: initial dynamic loss scale"})
    scale_growth_interval: int = field(default=200, metadata={"help": "fp16: double the scale after this many good steps"})
    max_skipped_steps: int = field(default=20, metadata={"help": "fp16: stop after this many inf/NaN steps in a row"})
    # --- eval, logging, checkpoints ---
    out_dir: str = field(default="out", metadata={"help": "run folder: metrics.jsonl, checkpoints/, adapter/"})
    eval_every: int = field(default=20, metadata={"help": "evaluate every N steps (0: only at the end)"})
    eval_batches: int = field(default=8, metadata={"help": "at most this many eval batches"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many checkpoints to keep"})
    log_every: int = field(default=1, metadata={"help": "print a progress line every N steps"})
    resume: str | None = field(default=None, metadata={"help": "a checkpoint folder, or 'auto' for the latest in out_dir"})
    overwrite: bool = field(default=False, metadata={"help": "reuse an out_dir that holds a previous run"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool", "bool | None") or f.type == (bool | None):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            typ = {int: int, float: float}.get(f.type, str)
            p.add_argument(flag, type=typ, default=f.default, help=f.metadata["help"])
    return TrainConfig(**vars(p.parse_args(argv)))


class UserError(Exception):
    """Bad input: printed as one message, no traceback."""


def fail(msg):
    raise UserError(msg)


def check_dtype(t, dtype, name):
    if t.dtype != dtype:
        fail(f"dtype drift: {name} is {t.dtype}, expected {dtype}")


# ----------------------------------------------------------------------------- setup


def validate(cfg: TrainConfig):
    for name in ("batch_size", "max_len", "grad_accum", "max_steps"):
        if getattr(cfg, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
    if not cfg.lr > 0:
        fail(f"--lr must be > 0, got {cfg.lr}")
    if cfg.lora_r <= 0:
        fail(f"--lora-r must be > 0, got {cfg.lora_r}")
    targets = [t for t in cfg.lora_targets.split(",") if t]
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets:
        fail(f"--lora-targets: unknown module(s) {unknown or '(none given)'}; this model has {','.join(ALL_TARGETS)}")
    if cfg.quantize not in (None, "nf4"):
        fail(f"--quantize must be nf4 (or left out), got {cfg.quantize!r}")
    if cfg.quantize == "nf4":
        try:
            import bitsandbytes  # noqa: F401  (model/qlora.py needs it; fail now, not after the data is read)
        except Exception as e:  # ImportError, or the error of a bitsandbytes whose native library fails to load
            fail(f"--quantize nf4 needs bitsandbytes, which cannot be imported ({type(e).__name__}: {e}). Install "
                 "it (pip install bitsandbytes), or leave out --quantize to train LoRA on the full-precision base")
    if cfg.dtype not in ("auto", "bf16", "fp16", "fp32"):
        fail(f"--dtype must be auto, bf16, fp16 or fp32, got {cfg.dtype!r}")


def setup_distributed(cfg):
    """(rank, world_size, device). torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; otherwise one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if cfg.device == "auto":
            return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, torch.device(cfg.device)
    local = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), world, torch.device(f"cuda:{local}" if use_cuda else "cpu")


def choose_dtype(cfg, device):
    """(dtype, reason). The base weights and activations use it; LoRA masters are always fp32."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    if cfg.dtype == "auto":
        if bf16_ok:
            return torch.bfloat16, "bf16: this GPU supports it (fp32 range, no loss scaling needed)"
        if cuda:
            return torch.float16, "fp16 with dynamic loss scaling: this GPU has no bf16"
        return torch.float32, "fp32: on CPU, bf16/fp16 matmuls are slow and fp16 is unsupported"
    if cfg.dtype == "bf16" and cuda and not bf16_ok:
        fail(f"--dtype bf16: this GPU ({torch.cuda.get_device_name(device)}) has no bf16; use --dtype fp16 "
             "(with loss scaling) or --dtype auto")
    if cfg.dtype == "fp16" and not cuda:
        fail("--dtype fp16 needs a CUDA GPU (fp16 matmuls are not supported on CPU); use --dtype fp32 on CPU")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype], "as requested"


def check_out_dir(cfg):
    """Refuse to mix runs, and check that out_dir can be written, before any long work. Writes nothing."""
    has_run = os.path.isdir(cfg.out_dir) and any(
        os.path.exists(os.path.join(cfg.out_dir, f)) for f in ("metrics.jsonl", "checkpoints", "train_config.json"))
    if has_run and not (cfg.overwrite or cfg.resume):
        fail(f"{cfg.out_dir!r} already holds a run. Pass --resume auto to continue it, --overwrite to replace "
             "it, or choose another --out-dir")
    where = nearest_existing(cfg.out_dir)
    try:  # os.access says yes to root even on a read-only mount: try for real (an unnamed file, gone on close)
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        fail(f"cannot write to --out-dir {cfg.out_dir!r} ({e.strerror}: {where!r}); choose a writable folder")


def nearest_existing(path):
    """`path`, or its closest ancestor that exists: where a folder not yet created will live."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_free_disk(cfg, model):
    need = 3 * sum(p.numel() * 4 for _, p in lora_parameters(model)) + (64 << 20)  # weights + 2 Adam moments
    free = shutil.disk_usage(nearest_existing(cfg.out_dir)).free
    if free < 2 * need:
        fail(f"only {free / 2**20:.0f} MiB free in {cfg.out_dir!r}, a checkpoint needs about "
             f"{need / 2**20:.0f} MiB (twice that while the previous one is kept); free space or use another --out-dir")


def check_vocab(tokenizer, model_cfg):
    if tokenizer.vocab_size > model_cfg.vocab_size:
        fail(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has {model_cfg.vocab_size} "
             "rows: they do not belong together. Use the tokenizer of this model")


def start_run_folder(cfg, step):
    """Create out_dir (rank 0, once every check has passed). --overwrite clears the previous run, so a later
    --resume auto cannot pick up its checkpoints; --resume drops the metrics past the checkpoint at `step`,
    which the resumed run writes again (its train records after `step`, its evals from `step` on)."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    if cfg.resume and os.path.exists(metrics):
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.endswith("\n")]  # a line cut by a kill has no \n
        keep = [r for r in records if r["step"] < step or (r["step"] == step and "loss" in r)]
        with open(metrics, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
    elif cfg.overwrite:
        for name in ("metrics.jsonl", "checkpoints", "adapter"):
            path = os.path.join(cfg.out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    with open(os.path.join(cfg.out_dir, "train_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)


def load_data(cfg, tokenizer):
    examples = data.load_examples(cfg.data)
    if cfg.data == "builtin" or cfg.data.startswith("builtin"):
        train_ex, eval_ex = examples, data.load_examples("builtin:eval")
    else:
        n_eval = min(200, int(len(examples) * cfg.eval_fraction)) if len(examples) >= 20 else 0
        rng = random.Random(cfg.seed)
        order = list(range(len(examples)))
        rng.shuffle(order)
        eval_ex = [examples[i] for i in order[:n_eval]]
        train_ex = [examples[i] for i in order[n_eval:]]
    enc = [data.encode_example(e, tokenizer, train_on_inputs=cfg.train_on_inputs) for e in train_ex]
    eval_enc = [data.encode_example(e, tokenizer) for e in eval_ex]
    fits = [e for e in enc if len(e[0]) <= cfg.max_len]
    if not fits:
        shortest = min(len(e[0]) for e in enc)
        fail(f"every training example is longer than --max-len {cfg.max_len} (the shortest has {shortest} tokens); "
             "raise --max-len or shorten the examples")
    if not any(any(m[1:]) for _, m in fits):  # a target needs a preceding token
        fail("no example has any target token (every label is masked): check the dataset's answers/assistant "
             "turns, or pass --train-on-inputs")
    if len(fits) < len(enc):
        print(f"data: dropped {len(enc) - len(fits)} of {len(enc)} examples longer than --max-len {cfg.max_len}")
    return fits, eval_enc


# ----------------------------------------------------------------------------- checkpoints


# What a checkpoint's state.pt holds: save_checkpoint writes these keys, find_checkpoint checks for them.
CHECKPOINT_KEYS = frozenset({"step", "config", "world_size", "lora", "optimizer", "state", "data", "rng"})


def checkpoints(out_dir):
    """The complete checkpoints of a run folder, oldest first."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))  # .tmp: incomplete
    return [os.path.join(root, d) for d in steps]


def save_checkpoint(cfg, model, optimizer, state, batches, step, rank, world):
    """Write everything a resume needs into a temp folder, then rename it into place (atomic):
    a save that is interrupted leaves only a stray *.tmp folder and every earlier checkpoint intact.
    Every rank calls it (each sends its RNG state); rank 0 writes. Returns the path on every rank."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    rngs = [rng] * world
    if world > 1:  # each rank's own dropout stream, so a resume continues every one of them exactly
        dist.all_gather_object(rngs, rng)
    root = os.path.join(cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:07d}")
    if rank != 0:
        return final
    os.makedirs(root, exist_ok=True)
    for d in os.listdir(root):
        if d.endswith(".tmp"):  # left by a save that was killed: incomplete, never read
            shutil.rmtree(os.path.join(root, d))
    tmp = final + ".tmp"
    try:
        os.makedirs(tmp)  # the folder name says it is incomplete until the rename below
        ck = {
            "step": step,
            "config": dataclasses.asdict(cfg),
            "world_size": world,
            "lora": {n: p.detach().cpu() for n, p in lora_parameters(model)},
            "optimizer": optimizer.state_dict(),
            "state": state,  # loss scale, good-step counter
            "data": batches.state_dict(),  # the same on every rank: they step together
            "rng": rngs,  # one per rank
        }
        assert ck.keys() == CHECKPOINT_KEYS, "CHECKPOINT_KEYS must name what a checkpoint holds"
        torch.save(ck, os.path.join(tmp, "state.pt"))
        save_adapter(model, os.path.join(tmp, "adapter"), base_model=cfg.model)
    except (OSError, RuntimeError) as e:  # disk full, quota, permissions (torch.save raises RuntimeError)
        shutil.rmtree(tmp, ignore_errors=True)
        earlier = checkpoints(cfg.out_dir)
        keep = (f"the last good checkpoint is {earlier[-1]}: continue from it with --resume auto once there is "
                "room" if earlier else "no earlier checkpoint exists")
        fail(f"cannot write checkpoint {final} ({e}). Free disk space in {cfg.out_dir} (or check its quota and "
             f"permissions); {keep}")
    if os.path.isdir(final):  # the same step saved again (a run resumed from an older checkpoint): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for path in checkpoints(cfg.out_dir)[:-cfg.keep_checkpoints]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def find_checkpoint(cfg, world):
    """The checkpoint that --resume names, read and checked against this run before any long work."""
    candidates = checkpoints(cfg.out_dir)[::-1] if cfg.resume == "auto" else [cfg.resume]
    candidates = [p for p in candidates if os.path.isfile(os.path.join(p, "state.pt"))]
    if not candidates:
        where = cfg.out_dir + "/checkpoints/step-*" if cfg.resume == "auto" else cfg.resume
        fail(f"--resume {cfg.resume}: no checkpoint found (looked for {where}/state.pt)")
    damaged = []
    for path in candidates:  # newest first: a damaged checkpoint falls back to the one before it
        try:
            ck = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
            if not CHECKPOINT_KEYS <= ck.keys():
                raise KeyError("not a nanotune checkpoint: keys missing")
            break
        except Exception as e:  # a truncated or overwritten file: any unpickling error
            damaged.append(f"{path} ({type(e).__name__}: {str(e)[:120]})")
            print(f"warning: cannot read checkpoint {damaged[-1]}", file=sys.stderr)
    else:
        fail(f"--resume {cfg.resume}: no readable checkpoint: {'; '.join(damaged)}. Checkpoints are written "
             "atomically, so something changed these files afterwards. Delete them and resume from an earlier "
             "one (--resume PATH), or start again in a new --out-dir")
    old = ck["config"]
    for key in ("model", "quantize", "lora_r", "lora_alpha", "lora_targets", "rslora"):
        if old[key] != getattr(cfg, key):
            fail(f"--resume {path}: the checkpoint was trained with {key}={old[key]!r}, this run has "
                 f"{getattr(cfg, key)!r}. Resume with the same model and LoRA settings, or start a new --out-dir")
    if ck["world_size"] != world:
        fail(f"--resume {path}: the checkpoint was written by {ck['world_size']} process(es), this run has "
             f"{world}. Resume with the same number (torchrun --nproc_per_node={ck['world_size']}): each process "
             "continues its own share of the data")
    ck["path"] = path
    return ck


def restore(ck, model, optimizer, batches, rank, device):
    """Load checkpoint `ck` (from find_checkpoint) into the run. Returns (step, loss-scaling state)."""
    params = dict(lora_parameters(model))
    with torch.no_grad():
        for n, t in ck["lora"].items():
            params[n].copy_(t.to(device))
    optimizer.load_state_dict(ck["optimizer"])
    batches.load_state_dict(ck["data"])
    rng = ck["rng"][rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return ck["step"], ck["state"]


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(model, eval_sets, device):
    """Mean loss per target token, answer accuracy (every answer token right, teacher-forced) and
    token accuracy, over the held-out batches."""
    model.eval()
    loss_sum, n_tok, tok_right, correct, total = 0.0, 0, 0, 0, 0
    for batch in eval_sets:
        b = {k: v.to(device) for k, v in batch.items()}
        n = data.num_targets(batch)
        if n == 0:
            continue
        logits = model(b["input_ids"], b["position_ids"], b["doc_ids"])  # (B, T, V)
        loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["targets"].flatten(),
                                                      ignore_index=data.IGNORE_INDEX, reduction="sum").item()
        n_tok += n
        tok_right += int(((logits.argmax(-1) == b["targets"]) & (b["targets"] != data.IGNORE_INDEX)).sum())
        c, t = data.answer_accuracy(logits, b)
        correct, total = correct + c, total + t
    model.train()
    return {"eval_loss": loss_sum / max(n_tok, 1), "eval_accuracy": correct / max(total, 1),
            "eval_token_accuracy": tok_right / max(n_tok, 1)}


def log_eval(step, result, metrics, log):
    log(f"eval step {step}: loss {result['eval_loss']:.4f}, answer accuracy {result['eval_accuracy']:.1%}, "
        f"token accuracy {result['eval_token_accuracy']:.1%}")
    if metrics is not None:
        metrics.write(json.dumps({"step": step, **result}) + "\n")
        metrics.flush()


def lr_at(cfg, step):
    """Linear warm-up, then cosine from lr down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------- main


@contextmanager
def stop_on_sigint():
    """A flag that SIGINT (Ctrl-C) sets instead of raising KeyboardInterrupt, so the loop can finish its step
    and checkpoint. Repeats only set it again (torchrun sends its workers one more); on exit the previous
    handler is back."""
    stop = {"requested": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(requested=True))
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def any_rank(flag, world, device):
    """`flag` or-ed over the ranks, so that all of them take the same branch (and meet in the same collectives)."""
    if world == 1:
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t)
    return bool(t)


def next_steps(last_ckpt, fix):
    """How to go on after the run stopped on NaN/inf: `fix`, then continue from the last good checkpoint."""
    if last_ckpt is None:
        return f"No checkpoint was saved yet: {fix} and start again"
    return f"The last good checkpoint is {last_ckpt}: {fix} and continue from it with --resume {last_ckpt}"


def main(cfg: TrainConfig):
    validate(cfg)
    rank, world, device = setup_distributed(cfg)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    dtype, why = choose_dtype(cfg, device)
    use_kernels = device.type == "cuda" if cfg.kernels is None else cfg.kernels
    log(f"device {device}, dtype {dtype}: {why}; kernels {'on' if use_kernels else 'off (torch references)'}")
    # Every input is checked before the slow work (the weights, the training), on every rank alike, and
    # nothing is written until all checks have passed.
    check_out_dir(cfg)
    resume_from = find_checkpoint(cfg, world) if cfg.resume else None
    tokenizer = load_tokenizer(cfg.model)
    if not cfg.model.endswith(".gguf"):  # config.json alone; a .gguf holds its tokenizer and weights together
        check_vocab(tokenizer, from_hf_config(read_hf_config(resolve(cfg.model))))
    train_enc, eval_enc = load_data(cfg, tokenizer)
    torch.manual_seed(cfg.seed + rank)  # dropout, different on each rank (the LoRA init has its own generator)
    random.seed(cfg.seed + rank)

    lora = LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                      targets=tuple(t for t in cfg.lora_targets.split(",") if t), rslora=cfg.rslora)
    model, mcfg = load_model(cfg.model, dtype=dtype, device=device, lora=lora, quantize=cfg.quantize,
                             use_kernels=use_kernels, lora_seed=cfg.seed)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    model.offload_activations = cfg.offload_activations
    check_free_disk(cfg, model)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    batches = data.Batches(train_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad,
                           packing=cfg.packing, seed=cfg.seed, rank=rank, world_size=world)
    eval_sets = data.eval_batches(eval_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad,
                                  packing=cfg.packing)[:cfg.eval_batches]
    params = [p for _, p in lora_parameters(model)]
    for p in params:
        check_dtype(p, torch.float32, "LoRA master weight")
    n_params = sum(p.numel() for p in params)
    log(f"model {cfg.model}: {mcfg.n_layers} layers, {n_params / 1e6:.2f}M trainable LoRA parameters "
        f"(r={cfg.lora_r} on {cfg.lora_targets}); {len(train_enc)} train / {len(eval_enc)} eval examples, "
        f"{len(batches)} batches per epoch{' (packed)' if cfg.packing else ' (padded)'}")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), fused=False)
    # fp16 dynamic loss scaling: multiply the loss by `scale` so small gradients survive fp16,
    # divide the gradients by it before clipping; on inf/NaN skip the step and halve the scale.
    state = {"scale": cfg.loss_scale if dtype == torch.float16 else 1.0, "good_steps": 0, "skipped_in_row": 0}
    step, last_ckpt = 0, None
    if resume_from:
        step, state = restore(resume_from, model, optimizer, batches, rank, device)
        last_ckpt = resume_from["path"]
        if dtype != torch.float16:  # a checkpoint of an fp16 run, resumed in bf16/fp32: no loss scaling
            state["scale"] = 1.0
        log(f"resumed from {last_ckpt} at step {step}")
    saved_step = step  # never re-save the checkpoint we start from
    ddp = None
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = ddp if ddp is not None else model
    if master:
        start_run_folder(cfg, step)
    metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") if master else None

    model.train()
    t_last, tokens_since = time.time(), 0
    with stop_on_sigint() as stop:  # Ctrl-C: finish the step, checkpoint, exit
        while step < cfg.max_steps:
            lr = lr_at(cfg, step)
            for g in optimizer.param_groups:
                g["lr"] = lr

            if cfg.save_every and step % cfg.save_every == 0 and step > saved_step:
                last_ckpt, saved_step = save_checkpoint(cfg, model, optimizer, state, batches, step, rank, world), step
            if cfg.eval_every and step % cfg.eval_every == 0 and eval_sets:
                log_eval(step, evaluate(model, eval_sets, device), metrics, log)

            micro = [next(batches) for _ in range(cfg.grad_accum)]
            n_targets = torch.tensor(sum(data.num_targets(b) for b in micro), device=device)
            if world > 1:  # every rank joins, even one whose micro-batches have no targets
                dist.all_reduce(n_targets)
            n_targets = int(n_targets)
            if n_targets == 0:  # the same on every rank
                log(f"warning: step {step + 1} has no target tokens (every label masked); skipping it")
                step += 1
                continue
            loss_sum = torch.zeros((), device=device)
            for i, batch in enumerate(micro):
                b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                check_dtype(b["input_ids"], torch.long, "input_ids")
                sync = ddp.no_sync() if ddp is not None and i < len(micro) - 1 else nullcontext()
                with sync:  # a rank without targets here still runs backward (zero grads): DDP's all-reduce needs it
                    loss = forward(b["input_ids"], b["position_ids"], b["doc_ids"], targets=b["targets"],
                                   num_targets=n_targets)  # Σ token losses of this micro-batch / n_targets
                    check_dtype(loss, torch.float32, "loss")
                    # DDP averages gradients over ranks; the loss is already divided by the global
                    # count, so multiply by world to get the gradient of the global sum / count.
                    (loss * (state["scale"] * world)).backward()
                loss_sum += loss.detach()
                tokens_since += b["input_ids"].numel() * world

            for p in params:
                if p.grad is not None:
                    check_dtype(p.grad, torch.float32, "LoRA gradient")
                    p.grad.div_(state["scale"])  # unscale before clipping, so the grad norm is the true one
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if world > 1:
                dist.all_reduce(loss_sum)
            loss_val = loss_sum.item()
            finite = math.isfinite(grad_norm.item()) and math.isfinite(loss_val)  # the same on every rank
            if dtype == torch.float16:
                if finite:
                    optimizer.step()
                    state["good_steps"] += 1
                    state["skipped_in_row"] = 0
                    if state["good_steps"] % cfg.scale_growth_interval == 0:
                        state["scale"] *= 2
                else:
                    state["scale"] = max(state["scale"] / 2, 1.0)
                    state["good_steps"] = 0
                    state["skipped_in_row"] += 1
                    log(f"step {step + 1}: inf/NaN gradients in fp16, skipped; loss scale -> {state['scale']:g}")
                    if state["skipped_in_row"] > cfg.max_skipped_steps:
                        fix = "lower --lr, or use --dtype bf16 where the GPU has it (or fp32),"
                        fail(f"{state['skipped_in_row']} fp16 steps in a row had inf/NaN gradients (up to step "
                             f"{step + 1}; loss scale now {state['scale']:g}), more than --max-skipped-steps "
                             f"{cfg.max_skipped_steps}. {next_steps(last_ckpt, fix)}")
            elif not finite:
                fail(f"the loss or gradient is NaN/inf at step {step + 1} (loss {loss_val:g}, grad norm "
                     f"{grad_norm.item():g}). {next_steps(last_ckpt, 'lower --lr (or check the data)')}")
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0 or step == cfg.max_steps:
                dt = time.time() - t_last
                tok_s = tokens_since / max(dt, 1e-9)
                mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
                rec = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tok_s,
                       "peak_mem_gib": mem, "loss_scale": state["scale"], "target_tokens": n_targets,
                       "skipped": not finite}
                scale = f" | scale {state['scale']:g}" if dtype == torch.float16 else ""
                log(f"step {step}/{cfg.max_steps} | loss {loss_val:.4f} | lr {lr:.2e} | grad norm {grad_norm.item():.3f} | "
                    f"{tok_s / 1e3:.1f}k tok/s{scale} | peak mem {mem:.2f} GiB")
                if master:
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                t_last, tokens_since = time.time(), 0
            if any_rank(stop["requested"], world, device):
                break

    if step > saved_step:
        last_ckpt = save_checkpoint(cfg, model, optimizer, state, batches, step, rank, world)
    if step < cfg.max_steps:
        log(f"interrupted after step {step}: saved {last_ckpt}. To continue, run the same command with --resume auto")
    else:
        if eval_sets:
            log_eval(step, evaluate(model, eval_sets, device), metrics, log)
        if master:
            save_adapter(model, os.path.join(cfg.out_dir, "adapter"), base_model=cfg.model)
            log(f"done: adapter in {os.path.join(cfg.out_dir, 'adapter')} (PEFT format), checkpoint {last_ckpt}")
    if master:
        metrics.close()
    if world > 1:
        dist.destroy_process_group()


def cli(argv=None):
    """The command line: bad input is one `error: ...` line and exit status 2, no traceback."""
    try:
        main(parse_args(argv))
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
