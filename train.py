"""nanotune: LoRA / QLoRA fine-tuning of Llama, Qwen and Gemma in one readable loop.

    python train.py --model tinyllama                     # the embedded dataset, defaults for the hardware
    python train.py --model ./my-model --data chats.jsonl --max-steps 500
    torchrun --nproc_per_node=2 train.py --model tinyllama  # data-parallel on 2 GPUs

The loop, top to bottom: set the lr -> checkpoint / evaluate -> micro-steps (forward,
backward) -> unscale, clip, step, zero_grad -> log. Ctrl-C (or SIGTERM) finishes the step,
saves a checkpoint and exits with status 130 (143); `--resume auto` then continues exactly
(weights, optimizer, loss scale, data position, RNG). Bad input fails before the weights
load, with one line that says the fix. The run folder and its checkpoints: checkpoint.py.

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
import re
import reprlib
import resource
import signal
import stat
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import tracking
from checkpoint import RunFolder, UserError, fingerprint, position, rewind, same_model
from cli import HelpFormatter, auto_device
from model import LoRAConfig, check_quantize, load_model, load_tokenizer, read_config, resolve
from model.hub import check_push, push
from model.generate import generate, stop_ids
from model.lora import ALL_TARGETS, lora_parameters
from step import EagerStep, GraphStep, WarmStart, graphs_off_reason, logits_bytes, shortest_bucket


# Defaults that depend on the hardware, for the options left unset (None in TrainConfig). On a CPU (and on
# Apple silicon, mps) a step of a 135M model at GPU sizes takes minutes: shorter rows and fewer eval batches
# keep a default run to minutes. The header line says which ones a run took; train_config.json records them.
GPU_DEFAULTS = {"max_len": 2048, "batch_size": 4, "max_steps": 60, "eval_batches": 8, "offload_activations": True}
CPU_DEFAULTS = {"max_len": 256, "batch_size": 4, "max_steps": 60, "eval_batches": 2, "offload_activations": False}


@dataclass
class TrainConfig:
    # --- model ---
    model: str = field(default="tinyllama", metadata={"help": "short name, hub repo id, local folder or .gguf file"})
    quantize: str | None = field(default=None, metadata={"help": "'nf4' for QLoRA (4-bit frozen base, needs bitsandbytes); "
                                                                 "left out: the base in --dtype", "choices": ("nf4",)})
    # --- LoRA ---
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; 16 is a common quality/size balance"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scale numerator: the update is scaled by alpha / r"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input (0 keeps the fused path fastest)"})
    lora_targets: str = field(default=",".join(ALL_TARGETS), metadata={"help": "comma-separated projections that get adapters",
                                                                     "choices": ALL_TARGETS, "separator": ","})
    rslora: bool = field(default=False, metadata={"help": "rank-stabilized LoRA: scale alpha / sqrt(r)"})
    # --- data ---
    data: str = field(default="builtin", metadata={"help": "'builtin', a .jsonl/.json/.csv/.txt/.parquet file or a "
                      "folder of them (FOLDER:split), a datasets save_to_disk folder, or a hub dataset "
                      "user/repo[@revision][:config]:split (or user/repo:path/file.jsonl); see docs/data.md"})
    eval_data: str | None = field(default=None, metadata={"help": "a separate eval set, in any form --data takes; "
                                                                  "--eval-fraction then does not apply"})
    max_examples: int | None = field(default=None, metadata={"help": "use only the first N rows of --data (quick runs)"})
    columns: str | None = field(default=None, metadata={"help": "read the dataset's columns as nanotune's fields: "
                                "field=column,... (e.g. instruction=question,output=answer or messages=dialog)"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja chat template file (or a "
                                      "tokenizer_config.json) that replaces the model's"})
    system_prompt: str | None = field(default=None, metadata={"help": "add this system turn to every chat that has none"})
    num_proc: int | None = field(default=None, metadata={"help": "processes that tokenize the data (default: every "
                                 "CPU); the tokenized data is cached in $NANOTUNE_CACHE/datasets "
                                 "(default ~/.cache/nanotune/datasets)"})
    max_len: int | None = field(default=None, metadata={"help": "tokens per row (packed) or longest example (padded)"})
    packing: bool = field(default=True, metadata={"help": "pack examples into full rows (per-document attention and positions)"})
    train_on_inputs: bool = field(default=False, metadata={"help": "also train on prompt tokens, not only answers"})
    eval_fraction: float = field(default=0.02, metadata={"help": "share of a user dataset held out for eval (builtin has its own split)"})
    # --- optimization ---
    batch_size: int | None = field(default=None, metadata={"help": "rows per micro-batch (per GPU)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int | None = field(default=None, metadata={"help": "optimizer steps (or give --num-epochs)"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (typical for LoRA; at most 1: AdamW moves "
                                                      "each weight by about lr per step)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the cosine decays to lr * this"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warm-up steps before the cosine"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the LoRA weights"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global grad norm to this (0: off)"})
    seed: int = field(default=1337, metadata={"help": "seed for LoRA init, data order and dropout"})
    # --- precision and memory ---
    dtype: str = field(default="auto", metadata={"help": "auto: bf16 where the GPU has it, else fp16 on GPU; fp32 on CPU and mps",
                                                 "choices": ("auto", "bf16", "fp16", "fp32")})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "recompute each decoder layer in "
                                                "backward: keeps only the layers' inputs for backward, at the cost of "
                                                "a second forward. Default: off on a CUDA GPU where every layer's "
                                                "activations (estimated) fit in half of the memory free after loading "
                                                "the model, else on"})
    offload_activations: bool | None = field(default=None, metadata={"help": "with checkpointing: keep the "
                                             "layer inputs in pinned CPU memory, copied out and back on a side stream "
                                             "beside the compute, at no measured cost in speed (model/offload.py)"})
    kernels: bool | None = field(default=None, metadata={"help": "Triton kernels (default: on with CUDA); --no-kernels runs the torch references"})
    cuda_graphs: str = field(default="auto", metadata={"choices": ("auto", "on", "off"), "help": "replay each micro-step from a CUDA "
                             "graph (step.py), which removes the per-step CPU cost of issuing its kernels. auto: on "
                             "with one CUDA GPU (QLoRA and LoRA dropout included). Padded batches are "
                             "padded further to a multiple of 64 tokens, and the count of documents up to a power of two (one "
                             "graph per such bucket): at most 63 extra padding tokens per row, which nothing attends "
                             "to or predicts. In a run of at most 100 micro-steps, rows "
                             "of at most 64 tokens are padded to 128: one graph fewer"})
    loss_scale: float = field(default=2.0 ** 16, metadata={"help": "fp16: initial dynamic loss scale"})
    scale_growth_interval: int = field(default=200, metadata={"help": "fp16: double the scale after this many good steps"})
    max_skipped_steps: int = field(default=20, metadata={"help": "fp16: stop after this many inf/NaN steps in a row"})
    # --- eval, logging, checkpoints ---
    out_dir: str = field(default="out", metadata={"help": "run folder: metrics.jsonl, checkpoints/, adapter/"})
    eval_every: int = field(default=20, metadata={"help": "evaluate every N steps (0: only at the end)"})
    eval_batches: int | None = field(default=None, metadata={"help": "at most this many eval batches"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many checkpoints to keep, the newest (0: keep all)"})
    log_every: int = field(default=1, metadata={"help": "print a progress line every N steps (on a terminal: the "
                                                          "progress bar's loss and tok/s)"})
    resume: str | None = field(default=None, metadata={"help": "a checkpoint folder, or 'auto': the newest in out_dir "
                                                               "(none there: a new run)"})
    resume_anyway: bool = field(default=False, metadata={"help": "with --resume: continue even if options that decide "
                                "the trajectory (batch size, grad accum, max steps, the lr schedule, seed, packing, "
                                "max len, dropout, the data) differ from the checkpoint's; the run then differs from "
                                "an uninterrupted one"})
    overwrite: bool = field(default=False, metadata={"help": "reuse an out_dir that holds a previous run"})
    device: str = field(default="auto", metadata={"help": "auto: cuda, then mps, then cpu. mps (Apple silicon) runs the "
                                                  "torch references and is untested here",
                                                  "choices": ("auto", "cpu", "cuda", "cuda:N", "mps")})
    report_to: str = field(default="none", metadata={"help": "none, or trackers that also get metrics.jsonl's records, "
                           "comma-separated: tensorboard, wandb, trackio (optional extras: pip install -e "
                           "\".[tensorboard]\" etc.)"})
    push_to_hub: str | None = field(default=None, metadata={"help": "at the end, upload the adapter (with its model "
                                    "card) to this hub model repo, user/name; needs `hf auth login` or HF_TOKEN"})
    # --- experience ---
    num_epochs: float | None = field(default=None, metadata={"help": "train this many passes over the data (1.5 is "
                                     "fine) instead of --max-steps: steps = ceil(epochs x batches per epoch / grad accum)"})
    sample_every: int = field(default=-1, metadata={"help": "generate answers to 3 held-out prompts (greedy) every N "
                              "steps and at the end, logged with metrics.jsonl; -1: only before training and at the end; "
                              "0: never"})

    def __post_init__(self):
        """Every option is checked here, once, before anything loads or is written: one line that says the fix."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{flag(f.name)} must be a finite number, got {value}")
        for name in ("batch_size", "max_len", "grad_accum", "max_steps", "log_every", "scale_growth_interval",
                     "num_epochs"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:  # None: decided by the hardware
                raise UserError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "eval_batches", "save_every", "keep_checkpoints",
                     "max_skipped_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UserError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        checks = [  # (holds, the error line)
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.lr <= 1, f"--lr must be at most 1 (AdamW moves each weight by about lr per step; LoRA uses "
                           f"1e-5 to 1e-3), got {self.lr:g}"),
            (self.lora_alpha > 0, f"--lora-alpha must be > 0 (the update is scaled by alpha / r), got {self.lora_alpha}"),
            (0 <= self.eval_fraction < 1, f"--eval-fraction must be at least 0 and below 1 (the share of a user "
                                          f"dataset held out for eval), got {self.eval_fraction}"),
            (0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be between 0 and 1 (the cosine decays to lr times "
                                          f"this; below 0 the lr turns negative), got {self.min_lr_ratio}"),
            (self.loss_scale >= 1, f"--loss-scale must be >= 1, got {self.loss_scale}"),
            (re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device),
             f"--device must be {', '.join(choices_of('device'))}, got {short(self.device)}"),
            (self.resume or not self.resume_anyway, "--resume-anyway goes with --resume (auto or a checkpoint folder)"),
            (not (self.resume and self.overwrite), "--overwrite replaces the run that --resume continues: pass one"),
            (self.max_steps is None or self.num_epochs is None, f"--max-steps {self.max_steps} and --num-epochs "
             f"{self.num_epochs} both set the run's length: pass one"),
            (self.sample_every >= -1, f"--sample-every must be a number of steps, -1 (only before training and at "
                                      f"the end) or 0 (never), got {self.sample_every}"),
        ]
        for holds, error in checks:
            if not holds:
                raise UserError(error)
        for name in ("quantize", "dtype", "cuda_graphs"):
            value = getattr(self, name)
            if value is not None and value not in choices_of(name):
                optional = " (or left out)" if value_kinds(name)[1] else ""
                raise UserError(f"{flag(name)} must be one of {', '.join(choices_of(name))}{optional}, got {short(value)}")
        targets = [t for t in self.lora_targets.split(",") if t]
        unknown = [t for t in targets if t not in ALL_TARGETS]
        if unknown or not targets:
            raise UserError(f"--lora-targets: unknown module(s) {unknown or '(none given)'}; this model has "
                            f"{','.join(ALL_TARGETS)}")
        try:
            self.lora()  # LoRAConfig checks the rank and the dropout
        except ValueError as e:
            raise UserError(f"{e} (--lora-r, --lora-dropout)") from e
        try:
            check_quantize(self.quantize)
            tracking.check_trackers(self.trackers())
            if self.push_to_hub:
                check_push(self.push_to_hub)
        except ValueError as e:
            raise UserError(str(e)) from e
        if self.quantize == "nf4":
            try:  # model/qlora.py needs it: fail now, not after the data is read
                from model.qlora import import_bitsandbytes
                import_bitsandbytes()
            except Exception as e:  # ImportError, or the error of a bitsandbytes whose native library fails to load
                raise UserError(f"--quantize nf4 needs bitsandbytes, which cannot be imported ({type(e).__name__}: "
                                f"{e}). Install it (pip install bitsandbytes), or leave out --quantize to train LoRA "
                                "on the full-precision base") from e

    def trackers(self) -> list[str]:
        return [] if self.report_to == "none" else [t for t in self.report_to.split(",") if t]

    def data_options(self) -> dict:
        """The keyword arguments of data.load_datasets."""
        names = ("data", "eval_data", "eval_fraction", "max_examples", "columns", "chat_template", "system_prompt",
                 "train_on_inputs", "max_len", "seed", "num_proc")
        return {n: getattr(self, n) for n in names}

    def lora(self) -> LoRAConfig:
        return LoRAConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=tuple(t for t in self.lora_targets.split(",") if t), rslora=self.rslora)


# ----------------------------------------------------------------------------- options


def flag(name):
    """The command-line flag of a TrainConfig field: max_len -> --max-len."""
    return "--" + name.replace("_", "-")


def config_field(name):
    return next(f for f in dataclasses.fields(TrainConfig) if f.name == name)


def choices_of(name):
    """The values a field takes, from its metadata (what --help lists and __post_init__ checks)."""
    return config_field(name).metadata["choices"]


def value_kinds(name):
    """(the field's type: bool, int, float or str; whether it may be None)."""
    f = config_field(name)
    kinds = typing.get_args(f.type) or (f.type,)
    return next(k for k in kinds if k is not type(None)), type(None) in kinds


def option_help(f):
    """The field's help, with its choices and, where the hardware decides it, its defaults on GPU and CPU."""
    text, choices = f.metadata["help"], f.metadata.get("choices")
    if choices and f.metadata.get("separator"):
        text += f" (any of: {', '.join(choices)})"
    if f.name in GPU_DEFAULTS:
        gpu, cpu = GPU_DEFAULTS[f.name], CPU_DEFAULTS[f.name]
        text += f" (default: {gpu}" + (f"; {cpu} on CPU and mps)" if cpu != gpu else ")")
    return text


def build_parser(defaults=True):
    """The command line of TrainConfig, plus --config. defaults=False: the options not given stay out of the
    parsed namespace, which then holds only what the command line says."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter,
                                argument_default=None if defaults else argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="read options from a .yaml or .json file "
                   "(docs/example-config.yaml; a run's train_config.json repeats that run); options on the command "
                   "line override it. "
                   f"{', '.join(map(flag, FOLDER_ACTIONS))} come from the command line only")
    for f in dataclasses.fields(TrainConfig):
        kind, _ = value_kinds(f.name)
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices and not f.metadata.get("separator") else None
        default = f.default if defaults else argparse.SUPPRESS
        if kind is bool:
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=option_help(f))
        else:
            p.add_argument(flag(f.name), type=kind, default=default, metavar=metavar, help=option_help(f))
    return p


def parse_args(argv=None) -> TrainConfig:
    """The TrainConfig of a command line: --config's file, then the options given on the command line over it.
    Of --max-steps and --num-epochs, one given on the command line replaces both of the file's."""
    config = build_parser().parse_args(argv).config  # also --help, and argparse's errors (an unknown flag)
    given = vars(build_parser(defaults=False).parse_args(argv))  # only what the command line says
    given.pop("config", None)
    values = read_config_file(config) if config else {}
    if given.keys() & {"max_steps", "num_epochs"}:
        values.pop("max_steps", None)
        values.pop("num_epochs", None)
    return TrainConfig(**{**values, **given})


# What to do with a run folder that holds a run: asked on the command line each time, never taken from a
# config file (a run's train_config.json records them; passed back, its overwrite: true would replace the run).
FOLDER_ACTIONS = ("resume", "resume_anyway", "overwrite")


def read_config_file(path):
    """The options of a .yaml/.yml or .json file, as TrainConfig keyword arguments. Keys are the option names
    with - or _ (max-len, max_len); each value is checked against its option's type. FOLDER_ACTIONS are
    skipped."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".json"):
        raise UserError(f"--config {path}: expected a .yaml, .yml or .json file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"--config {path}: cannot read it ({e.strerror})") from e
    if ext == ".json":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise UserError(f"--config {path}: not valid JSON ({e})") from e
    else:
        import yaml
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise UserError(f"--config {path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})") from e
    if raw is None:  # an empty file
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected option: value pairs at the top level, got a {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise UserError(f"--config {path}: unknown option {short(key)}; the options are those of train.py --help, "
                            "written max_len or max-len")
        if name not in FOLDER_ACTIONS:
            values[name] = config_value(name, value, f"--config {path}: {key}")
    return values


def config_value(name, value, where):
    """`value` (from a config file) as field `name` takes it: bool, int, float or str, or None where the field
    may be None. A number written as a string ("2e-4", which YAML reads as one) is converted."""
    kind, optional = value_kinds(name)
    if value is None:
        if optional:
            return None
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind in (int, float) and not isinstance(value, bool):
        if isinstance(value, int) or (kind is float and isinstance(value, float)):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    raise UserError(f"{where} must be {expected}{' or null' if optional else ''}, got {short(value)}")


def short(value):
    """repr(value), cut to a line: a config file's value may be huge (YAML aliases nest a few bytes into
    billions of items), and an error line repeats only its start. Cheap however large `value` is."""
    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset, r.maxstring, r.maxother, r.maxlong = 2, 4, 4, 4, 4, 60, 60, 40
    return r.repr(value)


class LossScaler:
    """fp16 dynamic loss scaling: the loss is multiplied by `scale` so that small gradients survive fp16, and
    the gradients are divided by it again before clipping. A step with inf/NaN gradients is skipped and halves
    the scale; `growth_interval` good steps in a row double it. Disabled (bf16, fp32): the scale stays 1."""

    def __init__(self, scale, growth_interval, enabled):
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = scale if enabled else 1.0
        self.good_steps, self.skipped_in_row = 0, 0

    def unscale_(self, params):
        """Divide the gradients by the scale, so that clipping sees the true gradient norm."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.scale != 1.0 and grads:
            torch._foreach_div_(grads, self.scale)

    def update(self, finite):
        """After each step: an applied one counts toward doubling the scale, a skipped one (inf/NaN) halves it."""
        if not self.enabled:
            return
        if finite:
            self.good_steps, self.skipped_in_row = self.good_steps + 1, 0
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        else:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps, self.skipped_in_row = 0, self.skipped_in_row + 1

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_in_row": self.skipped_in_row}

    def load_state_dict(self, state):
        if self.enabled:  # a checkpoint of an fp16 run, resumed in bf16/fp32, keeps the scale at 1
            self.scale = state["scale"]
        self.good_steps, self.skipped_in_row = state["good_steps"], state["skipped_in_row"]


# ----------------------------------------------------------------------------- setup


def pick_device(cfg) -> str:
    """The device of a one-process run ('cuda', 'cuda:N', 'mps' or 'cpu'): --device, with auto resolved by
    cli.auto_device. One error line, before anything loads or is written, for a device that is not there and
    for --kernels off CUDA (the Triton kernels run on NVIDIA GPUs only)."""
    name = auto_device() if cfg.device == "auto" else cfg.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {cfg.device}: torch sees no CUDA GPU (a CPU-only torch build, no driver, or "
                        "CUDA_VISIBLE_DEVICES hides them); use --device cpu, or auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise UserError(f"--device {cfg.device}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                        f"cuda:{torch.cuda.device_count() - 1}")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: torch sees no Apple silicon GPU (mps needs a Mac with Apple silicon and a "
                        "torch build with MPS); use --device cpu, or auto")
    if cfg.kernels and not name.startswith("cuda"):
        raise UserError(f"--kernels: the Triton kernels run on NVIDIA GPUs (CUDA), and this run is on {name}; leave "
                        "out --kernels (or pass --no-kernels) to run the torch references")
    return name


def with_hardware_defaults(cfg, device_name):
    """(cfg with its unset options filled in for the device it runs on (pick_device's name), the header line
    that names the CPU defaults taken, or None). GPU_DEFAULTS on CUDA, CPU_DEFAULTS on the CPU and mps;
    --max-steps stays unset when --num-epochs decides it (`schedule`)."""
    on_gpu = device_name.startswith("cuda")
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    unset = {k: v for k, v in defaults.items() if getattr(cfg, k) is None and not (k == "max_steps" and cfg.num_epochs)}
    cfg = dataclasses.replace(cfg, **unset)
    # The header names the sizes that differ; offload (off without a GPU) changes no result.
    told = {k: v for k, v in unset.items() if not on_gpu and v != GPU_DEFAULTS[k] and not isinstance(v, bool)}
    if not told:
        return cfg, None
    listed = ", ".join(f"{flag(k)[2:]} {v}" for k, v in told.items())
    return cfg, f"CPU defaults: {listed}; set them to override"


@contextmanager
def distributed(cfg, name):
    """(rank, world_size, device) of this process; `name` is pick_device's. torchrun sets
    RANK/LOCAL_RANK/WORLD_SIZE and the process group lives until the run ends; otherwise one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield 0, 1, torch.device(name)
        return
    local = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        yield dist.get_rank(), world, torch.device(f"cuda:{local}" if use_cuda else "cpu")
    finally:
        dist.destroy_process_group()


def choose_dtype(cfg, device):
    """(dtype, reason). The base weights and activations use it; LoRA masters are always fp32."""
    as_requested = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if device.type == "cuda":
        gpu, bf16_ok = torch.cuda.get_device_name(device), torch.cuda.is_bf16_supported()
        if cfg.dtype == "auto":
            if bf16_ok:
                return torch.bfloat16, f"bf16: this GPU ({gpu}) supports it (fp32 range, no loss scaling needed)"
            return torch.float16, f"fp16 with dynamic loss scaling: this GPU ({gpu}) has no bf16"
        if cfg.dtype == "bf16" and not bf16_ok:
            raise UserError(f"--dtype bf16: this GPU ({gpu}) has no bf16; use --dtype fp16 (with loss scaling) or "
                            "--dtype auto")
    elif device.type == "mps":
        if cfg.dtype == "auto":
            return torch.float32, ("fp32: the safe choice on Apple silicon (mps), untested here; --dtype bf16 or "
                                   "fp16 may be faster")
    else:
        if cfg.dtype == "auto":
            return torch.float32, "fp32: on CPU, bf16/fp16 matmuls are slow and fp16 is unsupported"
        if cfg.dtype == "fp16":
            raise UserError("--dtype fp16 needs a CUDA GPU (fp16 matmuls are not supported on CPU); use --dtype fp32 "
                            "on CPU")
    return as_requested[cfg.dtype], "as requested"


def load_inputs(cfg, log):
    """(the model's local path, its ModelConfig, tokenizer, training examples, eval examples, eval rows), tokenized
    and checked against the model's config. The model is resolved (downloaded) once, here."""
    path = resolve(cfg.model)
    tokenizer = load_tokenizer(path)
    mcfg = read_config(path)
    check_model_fit(cfg, mcfg, tokenizer)
    try:
        return (path, mcfg, tokenizer, *data.load_datasets(tokenizer, **cfg.data_options(), log=log, with_rows=True))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from e


def build_model(cfg, path, device, dtype, use_kernels, rank):
    """(the model with its LoRA adapters, its ModelConfig)."""
    torch.manual_seed(cfg.seed + rank)  # dropout, different on each rank (the LoRA init has its own generator)
    random.seed(cfg.seed + rank)
    model, mcfg = load_model(path, dtype=dtype, device=device, lora=cfg.lora(), quantize=cfg.quantize,
                             use_kernels=use_kernels, lora_seed=cfg.seed,
                             offload_activations=cfg.offload_activations)
    assert all(p.dtype == torch.float32 for _, p in lora_parameters(model)), "LoRA master weights are fp32"
    return model, mcfg


def make_step(off, cfg, forward, device, params, warmed, shortest, log):
    """The micro-step: replayed from CUDA graphs where that works (off: why not, from `graphs_off_reason`;
    warmed: whether a WarmStart ran, see GraphStep; shortest: the shortest length bucket, `shortest_bucket`)."""
    log("CUDA graphs on" if off is None else f"CUDA graphs off: {off}")
    if off:
        return EagerStep(forward, device)
    return GraphStep(forward, device, params, cfg.max_len, log, warmed, shortest)


def choose_checkpointing(cfg, mcfg, dtype, use_kernels, device, world):
    """(on, reason) for gradient checkpointing. Left unset, it is off on a CUDA GPU where the activations of
    every layer (`activation_bytes` without checkpointing) fit in half of the memory free after loading the
    model: the other half stays for the estimate's error, the CUDA graphs' pool and the allocator's slack.
    Off saves recomputing each layer's forward in backward. Every rank takes the same choice."""
    if cfg.gradient_checkpointing is not None:
        return cfg.gradient_checkpointing, "as requested"
    if device.type != "cuda":
        return True, "the default without a CUDA GPU, where free memory is not measured"
    need = activation_bytes(dataclasses.replace(cfg, gradient_checkpointing=False), mcfg, dtype, use_kernels)
    free = torch.cuda.mem_get_info(device)[0]
    if any_rank(need > free / 2, world, device):
        return True, (f"without it the activations (about {need / 2**30:.1f} GiB) would take more than half of the "
                      f"{free / 2**30:.1f} GiB of free GPU memory")
    return False, (f"the activations of every layer (about {need / 2**30:.1f} GiB) fit in half of the "
                   f"{free / 2**30:.1f} GiB of free GPU memory; --gradient-checkpointing uses less memory, more time")


def activation_bytes(cfg, mcfg, dtype, use_kernels):
    """A rough estimate of one micro-batch's activation memory on the GPU: the layer inputs kept for backward
    (every layer's with checkpointing, none with offload), one layer's activations with their gradients
    (every layer's without checkpointing), and the logits (`step.logits_bytes`)."""
    n, size = cfg.batch_size * cfg.max_len, torch.finfo(dtype).bits // 8  # tokens, bytes per activation
    h, q, kv = mcfg.hidden_size, mcfg.n_heads * mcfg.head_dim, mcfg.n_kv_heads * mcfg.head_dim
    layer = n * size * (4 * h + 2 * q + 2 * kv + 3 * mcfg.intermediate_size)  # norms, residuals, q k v o, MLP
    if mcfg.attn_softcap:  # explicit attention: fp32 scores and probabilities, (B, heads, T, T) each
        layer += 2 * 4 * cfg.batch_size * mcfg.n_heads * cfg.max_len ** 2
    if cfg.gradient_checkpointing:
        kept = 0 if cfg.offload_activations else mcfg.n_layers * n * h * size
        total = kept + 2 * layer
    else:
        total = (mcfg.n_layers + 1) * layer
    return total + logits_bytes(n, mcfg, dtype, use_kernels)


def memory_warning(cfg, mcfg, dtype, use_kernels, device):
    """A warning line when a micro-batch's activations (estimated) exceed the free GPU memory, else None."""
    if device.type != "cuda":
        return None
    need, free = activation_bytes(cfg, mcfg, dtype, use_kernels), torch.cuda.mem_get_info(device)[0]
    if need <= free:
        return None
    return (f"warning: a micro-batch of {cfg.batch_size} x {cfg.max_len} tokens needs about {need / 2**30:.1f} GiB "
            f"of activations, but {free / 2**30:.1f} GiB of GPU memory is free: expect out-of-memory. "
            f"To fit: {memory_fixes(cfg)}")


def memory_fixes(cfg):
    """What lowers the activation memory, among what this run does not do yet."""
    fixes = "lower --batch-size (a larger --grad-accum keeps the step's size) or --max-len"
    if not cfg.gradient_checkpointing:
        return fixes + ", or turn on --gradient-checkpointing (and --offload-activations)"
    return fixes + ("" if cfg.offload_activations else ", or add --offload-activations")


def describe(cfg, mcfg, params, train_enc, eval_enc, batches):
    return (f"model {cfg.model}: {mcfg.n_layers} layers, {sum(p.numel() for p in params) / 1e6:.2f}M trainable "
            f"LoRA parameters (r={cfg.lora_r} on {cfg.lora_targets}); {len(train_enc)} train / {len(eval_enc)} eval "
            f"examples, {len(batches)} batches per epoch{' (packed)' if cfg.packing else ' (padded)'}")


def schedule(cfg, batches_per_epoch):
    """The header lines on the run's length. --num-epochs becomes cfg.max_steps here, in place (the one option
    that the data decides), before the checkpoint check and train_config.json see it; --num-epochs is then
    cleared, so that train_config.json passed back to --config repeats the same steps. A warning when the
    warm-up takes the whole run."""
    given = f" (--num-epochs {cfg.num_epochs:g})" if cfg.num_epochs is not None else ""
    if cfg.num_epochs is not None:
        cfg.max_steps = max(1, math.ceil(cfg.num_epochs * batches_per_epoch / cfg.grad_accum))
        cfg.num_epochs = None
    epochs = cfg.max_steps * cfg.grad_accum / batches_per_epoch
    lines = [f"training {cfg.max_steps} steps: {epochs:.3g} epochs of {batches_per_epoch} batches{given}, "
             f"{cfg.grad_accum} micro-batch(es) per step"]
    if cfg.warmup_steps >= cfg.max_steps:
        lines.append(f"warning: --warmup-steps {cfg.warmup_steps} is not below the run's {cfg.max_steps} steps: the "
                     f"learning rate never reaches --lr {cfg.lr:g} and the cosine decay never starts; lower "
                     "--warmup-steps")
    return lines


def nf4_line(model):
    from model.qlora import nf4_bytes  # imports bitsandbytes: only for --quantize nf4
    return f"base weights quantized to NF4 ({nf4_bytes(model) / 2**30:.2f} GiB)"


def check_model_fit(cfg, mcfg, tokenizer=None):
    """The tokenizer and --max-len against the model's config."""
    if tokenizer is not None and tokenizer.vocab_size > mcfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
                        f"{mcfg.vocab_size} rows: they do not belong together. Use the tokenizer of this model")
    if cfg.max_len > mcfg.max_position_embeddings:
        raise UserError(f"--max-len {cfg.max_len} is longer than this model's context of "
                        f"{mcfg.max_position_embeddings} tokens (max_position_embeddings in its config): positions "
                        f"past it were never trained, and memory grows with the length. Use --max-len "
                        f"{mcfg.max_position_embeddings} or less")


def make_batches(cfg, tokenizer, train_enc, eval_enc, rank, world):
    """(the training batches of this rank, the eval batches)."""
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    batches = data.Batches(train_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad,
                           packing=cfg.packing, seed=cfg.seed, rank=rank, world_size=world)
    eval_sets = data.eval_batches(eval_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad,
                                  packing=cfg.packing)[:cfg.eval_batches]
    return batches, eval_sets


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
        token_loss, hit = model.score(b["input_ids"], b["position_ids"], b["doc_ids"], b["targets"])  # (B, T) each
        loss_sum += float(token_loss.sum())
        n_tok += n
        tok_right += int(hit.sum())
        c, t = data.answer_accuracy(hit, b)
        correct, total = correct + c, total + t
    model.train()
    if n_tok == 0:  # data.load_datasets refuses such an eval set; a loss of 0 here would read as perfect
        raise UserError("the eval batches hold no target token, so there is no eval loss to report; raise "
                        "--eval-batches or --max-len, or check the eval data's answers")
    return {"eval_loss": loss_sum / n_tok, "eval_accuracy": correct / max(total, 1),
            "eval_token_accuracy": tok_right / n_tok}


def log_eval(step, result, run, log):
    if result is None:  # no eval set
        return
    log(f"eval step {step}: loss {result['eval_loss']:.4f}, answer accuracy {result['eval_accuracy']:.1%}, "
        f"token accuracy {result['eval_token_accuracy']:.1%}")
    run.log({"step": step, **result})


SAMPLES, SAMPLE_TOKENS = 3, 48  # held-out prompts answered at each sampling; the longest answer in tokens


def sample_prompts(cfg, tokenizer, mcfg, rows, n=SAMPLES):
    """[(question, prompt ids, expected answer)] of the first n of the eval rows (data.load_datasets'
    with_rows) that have a prompt before their answer (data.held_out_prompt), rendered as in training
    (--chat-template, --system-prompt)."""
    tokenizer = data.use_chat_template(tokenizer, cfg.chat_template)
    cases = []
    for row in rows:
        case = data.held_out_prompt(row, tokenizer, cfg.system_prompt)
        if case is not None and len(case[1]) + SAMPLE_TOKENS <= mcfg.max_position_embeddings:
            cases.append(case)
            if len(cases) == n:
                break
    return cases


def one_line(text, width=80):
    """`text` on one line (whitespace runs as one space), cut to `width` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


class Samples:
    """--sample-every: the model's greedy answers (KV cache, at most SAMPLE_TOKENS tokens) to the first held-out
    prompts, on the console ("sample: prompt -> answer") and in metrics.jsonl as
    {"step": N, "samples": [{"prompt", "answer", "expected"}, ...]}. Rank 0 only: the others do not wait for it."""

    def __init__(self, cfg, tokenizer, mcfg, rows, log):
        self.every, self.tokenizer, self.stops = cfg.sample_every, tokenizer, stop_ids(tokenizer, mcfg)
        self.cases = sample_prompts(cfg, tokenizer, mcfg, rows)
        if not self.cases:
            log("samples: no held-out example has a prompt before its answer (plain text rows), so none are shown")

    def due(self, step):
        """Before training step step + 1: at step 0 (before any training), then every --sample-every steps."""
        return step == 0 if self.every == -1 else step % self.every == 0

    def log(self, step, model, run, log, final=False):
        if not self.cases:
            return
        model.eval()
        samples = [{"prompt": text, "answer": self.tokenizer.decode(generate(model, ids, SAMPLE_TOKENS,
                                                                           stop_ids=self.stops)).strip(),
                    "expected": expected} for text, ids, expected in self.cases]
        model.train()
        when = "after training" if final else "before training" if step == 0 else f"at step {step}"
        log(f"held-out samples {when} (greedy):")
        for sample in samples:
            log(f"sample: {one_line(sample['prompt'])} -> {one_line(sample['answer'])} (expected: "
                f"{one_line(sample['expected'], 40)})")
        run.log({"step": step, "samples": samples})


def lr_at(cfg, step):
    """Linear warm-up, then cosine from lr down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------- the step


def set_lr(optimizer, lr):
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def peak_mem(device):
    """GiB of GPU memory allocated at most so far (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def peak_rss_gib():
    """GiB of memory this process has held at most so far (its peak resident set size)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30


def count_targets(micro, world, device):
    """The target tokens of a step: over its micro-batches (counted on the CPU) and all ranks (every rank joins,
    even one without)."""
    n = sum(data.num_targets(b) for b in micro)
    if world > 1:
        t = torch.tensor(n, device=device)
        dist.all_reduce(t)
        n = int(t)
    return n


def issue_update(optimizer, loss_sum, grad_norm, world):
    """optimizer.step(), issued before the host has read the step's loss and grad norm: fused AdamW reads
    found_inf on the device and leaves the weights and its state as they were where it is 1 (a NaN/inf loss or
    gradient). So the CPU queues the update while the GPU is still running the step's backward, and reads the
    numbers afterwards (`step_stats`). loss_sum becomes the sum over ranks, so that every rank decides alike."""
    if world > 1:
        dist.all_reduce(loss_sum)
    optimizer.found_inf = (~(loss_sum.isfinite() & grad_norm.isfinite())).float()
    optimizer.step()


def step_stats(loss_sum, grad_norm):
    """(the step's loss, its grad norm) as floats: the step's one host sync."""
    loss, norm = torch.stack([loss_sum, grad_norm.to(loss_sum.dtype)]).tolist()
    return loss, norm


def updates_applied(optimizer):
    """How many updates AdamW has applied to the adapter (a skipped step does not count); 0 before the first."""
    return max((int(s["step"]) for s in optimizer.state.values()), default=0)


def check_step(optimizer, scaler, loss, norm, step, cfg, run, log):
    """The host's part of a step whose update `issue_update` queued: where the loss or grad norm is NaN/inf (the
    update was skipped on the device), fp16 backs the loss scale off and stops after too many such steps in a
    row; bf16 and fp32 stop at once. Returns whether the step's update was applied."""
    finite = math.isfinite(loss) and math.isfinite(norm)  # the same on every rank
    if not finite and not scaler.enabled:
        # Without any update yet the adapter is as initialized, so the learning rate cannot be the cause.
        cause = ("This is before any update of the adapter, so the learning rate is not the cause: the input "
                 "holds a NaN/inf. Check the base model's weights, the data and the options (e.g. --lora-alpha), "
                 "then start again" if not updates_applied(optimizer)
                 else run.next_steps("lower --lr (or check the data)"))
        raise UserError(f"the loss or gradient is NaN/inf at step {step} (loss {loss:g}, grad norm {norm:g}). {cause}")
    scaler.update(finite)
    if not finite:
        log(f"step {step}: inf/NaN gradients in fp16, skipped; loss scale -> {scaler.scale:g}")
        if scaler.skipped_in_row > cfg.max_skipped_steps:
            fix = "lower --lr, or use --dtype bf16 where the GPU has it (or fp32),"
            raise UserError(f"{scaler.skipped_in_row} fp16 steps in a row had inf/NaN gradients (up to step {step}; "
                            f"loss scale now {scaler.scale:g}), more than --max-skipped-steps "
                            f"{cfg.max_skipped_steps}. {run.next_steps(fix)}")
    return finite


def human_rate(tokens_per_s):
    """17 tok/s, 950 tok/s, 1.2k tok/s, 35.1k tok/s, 1.2M tok/s."""
    if tokens_per_s < 999.5:
        return f"{tokens_per_s:.0f} tok/s"
    if tokens_per_s < 999_950:
        return f"{tokens_per_s / 1e3:.1f}k tok/s"
    return f"{tokens_per_s / 1e6:.1f}M tok/s"


def human_duration(seconds):
    """45 s, 12 min, 2.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """The console while training. On a terminal, a tqdm bar: steps, ETA, and the loss and tokens/s as its
    postfix; elsewhere (a file, CI) one plain line every --log-every steps. Tokens/s counts training time only:
    what runs between pause() and resume() (checkpoints, evals, samples) is left out. After the run's second
    step, one line estimates the time of the steps left from that step's time (the first one carries one-time
    costs: kernel compilation, CUDA-graph capture, the allocator's warm-up)."""

    def __init__(self, step, max_steps, log, bar):
        self.log, self.max_steps, self.first_step = log, max_steps, step
        self.bar = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout) if bar else None
        self.window_start = time.perf_counter()  # since the last line
        self.paused_at, self.paused = None, 0.0  # seconds of the window spent paused
        self.step_start, self.step_paused = self.window_start, 0.0  # the same, for the step under way

    def pause(self):
        self.paused_at = time.perf_counter()

    def resume(self):
        pause = time.perf_counter() - self.paused_at
        self.paused, self.step_paused = self.paused + pause, self.step_paused + pause

    def busy(self):
        """Seconds of training since the last line."""
        return max(time.perf_counter() - self.window_start - self.paused, 1e-9)

    def tokens_per_s(self, tokens):
        return tokens / self.busy()

    def advance(self, step):
        """Step `step` is done: the bar moves; after the run's second step, the estimated time of the rest."""
        now = time.perf_counter()
        took, self.step_start, self.step_paused = now - self.step_start - self.step_paused, now, 0.0
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if step == self.first_step + 2 and step < self.max_steps:
            left = self.max_steps - step
            steps = f"{left} step{'s' if left != 1 else ''}"
            self.log(f"estimated time: about {human_duration(took * left)} for the {steps} left ({took:.3g} s per "
                     "step after the first; evals and checkpoints add to it)")

    def show(self, rec, line):
        """A logged step: the bar's postfix on a terminal, else `line`. The next rate counts from here."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {rec['loss']:.4f}, {human_rate(rec['tokens_per_s'])}")
        else:
            self.log(line)
        self.window_start, self.paused = time.perf_counter(), 0.0

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def log_step(run, progress, rec, max_steps, fp16, device):
    """The step's progress (a line, or the bar's postfix on a terminal) and its record in metrics.jsonl."""
    scale = f" | scale {rec['loss_scale']:g}" if fp16 else ""
    mem = f"peak mem {rec['peak_mem_gib']:.2f} GiB" if device.type == "cuda" else f"RSS {peak_rss_gib():.2f} GiB"
    progress.show(rec, f"step {rec['step']}/{max_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad norm "
                       f"{rec['grad_norm']:.3f} | {human_rate(rec['tokens_per_s'])}{scale} | {mem}")
    run.log(rec)


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM (schedulers, `timeout`, container stops) and SIGHUP (the terminal or ssh
    connection went away), handled alike; SIGHUP stays ignored where the run started with it ignored (`nohup`).
    After a hangup the console is gone: its output goes to /dev/null, so that no print fails during the save
    (writes to a hung-up terminal fail with EIO). Before training
    (stage "setup") one interrupts at once: there is nothing to save yet. From then on they stop the run
    between steps, never inside a step or a save: the first asks the loop to stop after its step and save a
    checkpoint; the second says to wait (torchrun passes each Ctrl-C on to its workers, so they see two);
    the third aborts, losing the save in progress (the checkpoints before it stay whole). In stage "saving"
    (the final checkpoint, eval and adapter) they only say to wait, up to the third. The lines go straight
    to stderr: a handler that printed through sys.stdout could land inside a print in progress."""

    def __init__(self, say):
        self.say = say  # whether this process prints (rank 0)
        self.stage = "setup"  # then "training", then "saving"
        self.count, self.signum = 0, None
        self.step = 0  # the step in progress (the loop sets it)
        self.stop_after = None  # the step in progress when the first signal came
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN or sig != signal.SIGHUP:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def due(self, completed):
        """Whether the run stops now, with `completed` steps done. The loop sets `step` before asking, so a
        signal on either side of the question names the step the run stops after."""
        return self.stop_after is not None and self.stop_after <= completed

    def exit_status(self):
        """128 + the signal's number, as a shell reports a process that a signal ended: 130 for Ctrl-C."""
        return 128 + (self.signum or signal.SIGINT)

    def _handle(self, signum, frame):
        if signum == signal.SIGHUP:
            detach_console()
        self.count += 1
        self.signum = self.signum or signum
        if self.stage == "setup" or self.count >= 3:
            raise KeyboardInterrupt(signum)
        if self.count == 1 and self.stage == "training":
            self.stop_after = self.step
            line = (f"{signal.Signals(signum).name}: stopping after step {self.step}, then saving a checkpoint "
                    "(two more Ctrl-C abort without saving)")
        else:
            line = "saving, please wait" + (" (one more Ctrl-C aborts: the save in progress is lost)"
                                            if self.count == 2 else "")
        if self.say:
            try:
                os.write(2, (line + "\n").encode())
            except OSError:  # no console left to say it on
                pass


def detach_console():
    """Point standard output and error at /dev/null where they are a terminal (a character device): after a
    hangup every write to it fails, and the run must go on to save without one."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode) and not os.path.samestat(os.fstat(fd), os.fstat(null)):
                os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def save_after_failure(e, cfg, run, step, model, optimizer, scaler, batches, start):
    """The one-line error for a write that failed (disk full) or a step that ran out of GPU memory, after a
    checkpoint of the last complete step where one can be saved: by a single process (with several, the
    others are not in the save), with finite weights. An out-of-memory step is first rewound to the data
    position and random state it started from, so that the checkpoint resumes exactly."""
    if isinstance(e, torch.OutOfMemoryError):
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if start is not None:
            rewind(batches, start)
        what = f"out of GPU memory in step {step + 1} (micro-batches of {cfg.batch_size} x {cfg.max_len} tokens)"
        fix = memory_fixes(cfg) + " (a resume with other sizes needs --resume-anyway)"
    else:
        what, fix = f"cannot write {e.filename or 'to disk'} ({e.strerror or e})", f"free disk space in {cfg.out_dir}"
    if step > run.saved_step and run.world == 1:
        try:
            run.save(step, model, optimizer, scaler, batches)
        except UserError:
            what += "; no checkpoint of it could be written either"
    return UserError(f"{what}. {run.next_steps(fix)}")


def any_rank(flag, world, device):
    """`flag` or-ed over the ranks, so that all of them take the same branch (and meet in the same collectives)."""
    if world == 1:
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t)
    return bool(t)


# ----------------------------------------------------------------------------- main


def main(cfg: TrainConfig) -> int:
    """Train; returns the exit status: 0 when the run is complete, 128 + the signal's number (130 for Ctrl-C)
    when a signal stopped it early, after its checkpoint."""
    device_name = pick_device(cfg)
    cfg, cpu_defaults = with_hardware_defaults(cfg, device_name)
    with (distributed(cfg, device_name) as (rank, world, device), RunFolder(cfg, rank, world) as run,
          StopSignals(say=rank == 0) as signals):
        log = tqdm.write if rank == 0 else (lambda *a, **k: None)  # tqdm.write: a line above a progress bar
        dtype, why = choose_dtype(cfg, device)
        use_kernels = device.type == "cuda" if cfg.kernels is None else cfg.kernels
        log(f"device {device}, dtype {dtype}: {why}; kernels {'on' if use_kernels else 'off (torch references)'}")
        if cpu_defaults:
            log(cpu_defaults)
        # Every input is checked before the slow work (the weights, the training), on every rank alike, and
        # nothing is written until all checks have passed.
        run.check()
        if cfg.eval_data and same_model(cfg.eval_data, cfg.data):
            run.warn(f"--eval-data is the training data ({cfg.data}): the eval loss then says how well the model "
                     "memorized it, not how it does on new examples")
        path, mcfg, tokenizer, train_enc, eval_enc, eval_rows = load_inputs(cfg, log)
        batches, eval_sets = make_batches(cfg, tokenizer, train_enc, eval_enc, rank, world)
        for line in schedule(cfg, len(batches)):  # --num-epochs decides --max-steps here
            log(line)
        graphs_off = graphs_off_reason(cfg.cuda_graphs, device, world)
        shortest = shortest_bucket(cfg.max_steps * cfg.grad_accum)  # how short batches are padded for the graphs
        # The first step's one-time costs, paid while the model loads. Not where --gradient-checkpointing asks
        # for less memory: the warm-up's copy of the model would raise the process's peak during the loading.
        warm = None if cfg.gradient_checkpointing else WarmStart.start(
            mcfg, batches.peek(), device, dtype, lora=cfg.lora(), quantize=cfg.quantize,
            use_kernels=use_kernels, max_len=None if graphs_off else cfg.max_len, shortest=shortest, log=log)
        ck = run.find(fingerprint(train_enc), fingerprint(eval_enc or []))
        model, mcfg = build_model(cfg, path, device, dtype, use_kernels, rank)
        # --gradient-checkpointing left unset takes its value here, in place (train_config.json records it)
        cfg.gradient_checkpointing, why = choose_checkpointing(cfg, mcfg, dtype, use_kernels, device, world)
        model.gradient_checkpointing = cfg.gradient_checkpointing
        log(f"gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}: {why}")
        run.check_free_disk(model)
        params = [p for _, p in lora_parameters(model)]
        log(describe(cfg, mcfg, params, train_enc, eval_enc, batches))
        if cfg.quantize:
            log(nf4_line(model))
        samples = Samples(cfg, tokenizer, mcfg, eval_rows, log) if cfg.sample_every and rank == 0 else None
        if warning := memory_warning(cfg, mcfg, dtype, use_kernels, device):  # CUDA only
            log(warning)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999),
                                      fused=True)  # one kernel for all weights; skips NaN/inf steps on the device
        scaler = LossScaler(cfg.loss_scale, cfg.scale_growth_interval, enabled=dtype == torch.float16)
        step = run.restore(ck, model, optimizer, scaler, batches)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else None
        forward = ddp if ddp is not None else model
        run.open(step)

        model.train()
        progress = Progress(step, cfg.max_steps, log, bar=rank == 0 and sys.stdout.isatty())
        # inside the timed window: what the loading did not hide counts as the first step's
        warmed = warm is not None and warm.join()
        micro_step = make_step(graphs_off, cfg, forward, device, params, warmed, shortest, log)
        tokens, start = 0, None
        signals.step, signals.stage = step, "training"  # a signal now stops the run after its step
        try:
            while step < cfg.max_steps:
                signals.step = step + 1
                if any_rank(signals.due(step), world, device):
                    break
                start = position(batches)  # where an out-of-memory step rewinds to
                lr = set_lr(optimizer, lr_at(cfg, step))
                progress.pause()  # checkpoints, evals and samples are not training time
                if cfg.save_every and step % cfg.save_every == 0 and step > run.saved_step:
                    run.save(step, model, optimizer, scaler, batches)
                if cfg.eval_every and step % cfg.eval_every == 0 and eval_sets:
                    log_eval(step, evaluate(model, eval_sets, device), run, log)
                if samples and samples.due(step):
                    samples.log(step, model, run, log)
                progress.resume()

                micro = [next(batches) for _ in range(cfg.grad_accum)]
                n_targets = count_targets(micro, world, device)
                if n_targets == 0:  # the same on every rank
                    log(f"warning: step {step + 1} has no target tokens (every label masked); skipping it")
                    step += 1
                    continue
                loss_sum = torch.zeros((), device=device)
                for i, batch in enumerate(micro):
                    # DDP all-reduces the gradients in the last micro-step's backward only. A rank without
                    # targets here still runs backward (zero grads): the all-reduce needs every rank.
                    with ddp.no_sync() if ddp is not None and i < len(micro) - 1 else nullcontext():
                        loss_sum += micro_step(batch, n_targets, scaler.scale * world)
                tokens += sum(b["input_ids"].numel() for b in micro) * world

                scaler.unscale_(params)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
                issue_update(optimizer, loss_sum, grad_norm, world)  # skipped on the device if not finite
                optimizer.zero_grad(set_to_none=not micro_step.graphed)  # a graph adds into fixed .grad buffers
                loss, norm = step_stats(loss_sum, grad_norm)
                applied = check_step(optimizer, scaler, loss, norm, step + 1, cfg, run, log)
                step += 1

                progress.advance(step)
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    log_step(run, progress, {
                        "step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                        "tokens_per_s": progress.tokens_per_s(tokens), "peak_mem_gib": peak_mem(device),
                        "loss_scale": scaler.scale, "target_tokens": n_targets, "skipped": not applied},
                        cfg.max_steps, scaler.enabled, device)
                    tokens = 0

            progress.close()
            signals.stage = "saving"  # a signal from here on only says to wait
            if step > run.saved_step:
                run.save(step, model, optimizer, scaler, batches)
            if step < cfg.max_steps:
                log(f"interrupted after step {step}: saved {run.last}. To continue, run the same command with "
                    "--resume auto")
                return signals.exit_status()
            final = evaluate(model, eval_sets, device) if eval_sets else None
            log_eval(step, final, run, log)
            if samples:
                samples.log(step, model, run, log, final=True)
            adapter = run.save_adapter(model, metrics=final)
            log(f"done: adapter in {adapter} (PEFT format), checkpoint {run.last}")
            if cfg.push_to_hub and rank == 0:
                log(f"pushed the adapter to {push(adapter, cfg.push_to_hub)}")
            return 0
        except (OSError, torch.OutOfMemoryError) as e:  # a write that failed (disk full), or a step too big
            raise save_after_failure(e, cfg, run, step, model, optimizer, scaler, batches, start) from e


def cli(argv=None):
    """The command line: bad input is one `error: ...` line and exit status 2, no traceback. A run that a
    signal stopped exits with 128 + its number (130 for Ctrl-C), also when a third one aborted its save."""
    cfg = None
    try:
        cfg = parse_args(argv)
        return main(cfg)
    except (UserError, ValueError, FileNotFoundError, ImportError) as e:  # ImportError: an optional package
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        saved = RunFolder(cfg).checkpoints() if cfg is not None else []
        where = (f"the newest checkpoint is {saved[-1]}: continue from it with --resume auto" if saved else
                 "no checkpoint was saved")
        print(f"interrupted: {where}", file=sys.stderr)
        return 128 + (e.args[0] if e.args else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(cli())
