"""The run's options: TrainConfig (each option, its default and its check), the command line and config files
that fill it, and the choices that depend on the hardware (device, dtype, defaults for options left unset).

    cfg = parse_args(argv)                      # --config FILE, then the command line over it; checked
    device_name = pick_device(cfg)              # --device auto -> cuda / mps / cpu
    cfg, note = with_hardware_defaults(cfg, device_name)
    dtype, why = choose_dtype(cfg, device)

Bad input raises UserError: train.py prints it as one line and exits with status 2.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import reprlib
import typing
from dataclasses import dataclass, field

import torch

import tracking
from cli import HelpFormatter, auto_device
from full import parse_train_modules, train_filter
from model import LoRAConfig, check_quantize
from model.embeddings import parse_tokens
from model.hub import check_push
from model.lora import ALL_TARGETS, BASE_MOVING_INITS, LORA_INITS
from preference import METHODS, Objective

USAGE = """nanotune: LoRA / QLoRA fine-tuning of Llama, Qwen and Gemma.

    python train.py --model tinyllama                     # the embedded dataset, defaults for the hardware
    python train.py --model ./my-model --data chats.jsonl --max-steps 500
    torchrun --nproc_per_node=2 train.py --model tinyllama  # data-parallel on 2 GPUs
"""


class UserError(Exception):
    """Bad input, or a run-folder problem the user must fix: printed as one line, no traceback."""


# Defaults that depend on the hardware, for the options left unset (None in TrainConfig). On a CPU (and on
# Apple silicon, mps) a step of a 135M model at GPU sizes takes minutes: shorter rows and fewer eval batches
# keep a default run to minutes. The header line says which ones a run took; train_config.json records them.
GPU_DEFAULTS = {"max_len": 2048, "batch_size": 4, "max_steps": 60, "eval_batches": 8, "offload_activations": True}
CPU_DEFAULTS = {"max_len": 256, "batch_size": 4, "max_steps": 60, "eval_batches": 2, "offload_activations": False}


@dataclass
class TrainConfig:
    # --- model ---
    model: str = field(default="tinyllama", metadata={"help": "short name, hub repo id, local folder or .gguf file"})
    tokenizer: str | None = field(default=None, metadata={"help": "the tokenizer to use: a model folder or .gguf "
                                  "file (default: the --model's own)"})
    quantize: str | None = field(default=None, metadata={"help": "'nf4' for QLoRA (4-bit frozen base, needs "
                                 "bitsandbytes); left out: the base in --dtype", "choices": ("nf4",)})
    # --- LoRA ---
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; 16 is a common quality/size balance"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scale numerator: the update is scaled by "
                              "alpha / r"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input (0 keeps the fused path "
                                "fastest)"})
    lora_targets: str = field(default=",".join(ALL_TARGETS), metadata={"help": "comma-separated projections that "
                              "get adapters", "choices": ALL_TARGETS, "separator": ","})
    rslora: bool = field(default=False, metadata={"help": "rank-stabilized LoRA: scale alpha / sqrt(r)"})
    dora: bool = field(default=False, metadata={"help": "DoRA: a trained magnitude per output row of W + (alpha/r) "
                       "B A (docs/adapters.md); with --lora-dropout it runs on the unfused LoRA path"})
    lora_plus_ratio: float = field(default=1.0, metadata={"help": "LoRA+: B (and DoRA's magnitude) learns at lr "
                                   "times this; 1 is plain LoRA, the LoRA+ paper uses 16"})
    lora_init: str = field(default="default", metadata={"help": "how the adapter starts: default (B = 0), "
                           "gaussian, or pissa / olora (from W's SVD / QR, moved out of the base; saved as a plain "
                           "LoRA of rank 2r on the original base)", "choices": LORA_INITS})
    train_embeddings: bool = field(default=False, metadata={"help": "train embed_tokens and lm_head (fp32) "
                                   "alongside LoRA, saved as PEFT's modules_to_save; see docs/embeddings.md"})
    add_tokens: str | None = field(default=None, metadata={"help": "comma-separated new tokens (e.g. '<tool>,</tool>')"
                                   ": the tokenizer gains them, their embedding rows start at the mean row and "
                                   "train (only they, without --train-embeddings)"})
    # --- full fine-tuning (full.py, docs/full_finetuning.md) ---
    full: bool = field(default=False, metadata={"help": "train the model's own weights instead of LoRA adapters "
                       "(every weight, or --train-modules); the result is a Hugging Face model folder, out/model/"})
    train_modules: str | None = field(default=None, metadata={"help": "with --full: train only these, comma-separated: "
                                      "projection names (q_proj,...,down_proj), norm, embed_tokens, lm_head, and "
                                      "layers.N or layers.A-B (e.g. q_proj,v_proj,layers.0-3); default: every weight"})
    # --- data ---
    data: str = field(default="builtin", metadata={"help": "'builtin' (or 'builtin:arithmetic', harder "
                      "tasks), a .jsonl/.json/.csv/.txt/.parquet file or a "
                      "folder of them (FOLDER:split), a datasets save_to_disk folder, or a hub dataset "
                      "user/repo[@revision][:config]:split (or user/repo:path/file.jsonl); see docs/data.md"})
    eval_data: str | None = field(default=None, metadata={"help": "a separate eval set, in any form --data takes; "
                                                                  "--eval-fraction then does not apply"})
    max_examples: int | None = field(default=None, metadata={"help": "use only the first N rows of --data (quick "
                                     "runs)"})
    columns: str | None = field(default=None, metadata={"help": "read the dataset's columns as nanotune's fields: "
                                "field=column,... (e.g. instruction=question,output=answer or messages=dialog)"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja chat template file (or a "
                                      "tokenizer_config.json) that replaces the model's"})
    system_prompt: str | None = field(default=None, metadata={"help": "add this system turn to every chat that has "
                                      "none"})
    num_proc: int | None = field(default=None, metadata={"help": "processes that tokenize the data (default: every "
                                 "CPU); the tokenized data is cached in $NANOTUNE_CACHE/datasets "
                                 "(default ~/.cache/nanotune/datasets)"})
    max_len: int | None = field(default=None, metadata={"help": "tokens per row (packed) or longest example (padded)"})
    packing: bool = field(default=True, metadata={"help": "pack examples into full rows (per-document attention and "
                          "positions)"})
    train_on_inputs: bool = field(default=False, metadata={"help": "also train on prompt tokens, not only answers"})
    eval_fraction: float = field(default=0.02, metadata={"help": "share of a user dataset held out for eval (builtin "
                                 "has its own split)"})
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
    # --- the objective (preference.py, docs/preference.md) ---
    method: str = field(default="sft", metadata={"help": "sft: supervised fine-tuning on answers; dpo, ipo, simpo, "
                        "orpo: preference tuning on prompt/chosen/rejected pairs (docs/preference.md)",
                        "choices": ("sft",) + METHODS})
    beta: float | None = field(default=None, metadata={"help": "dpo, ipo, simpo: the beta of the loss (how far the "
                               "policy may move; default 0.1 for dpo and ipo, 2.0 for simpo)"})
    label_smoothing: float = field(default=0.0, metadata={"help": "dpo, simpo: the share of pairs assumed to be "
                                   "mislabeled (conservative DPO), from 0 to below 0.5"})
    simpo_gamma: float = field(default=0.5, metadata={"help": "simpo: the target reward margin gamma"})
    orpo_lambda: float = field(default=0.1, metadata={"help": "orpo: the weight of the odds-ratio term beside the "
                               "NLL of the chosen answer (TRL's beta)"})
    precompute_ref: bool = field(default=False, metadata={"help": "dpo, ipo: compute the reference model's "
                                 "log-probabilities (the base, adapters off) once per pair before training, in "
                                 "batches, instead of a second forward at every step; computed again at every start "
                                 "of a run, resumed ones too"})
    # --- precision and memory ---
    dtype: str = field(default="auto", metadata={"help": "auto: bf16 where the GPU has it, else fp16 on GPU; fp32 on "
                       "CPU and mps", "choices": ("auto", "bf16", "fp16", "fp32")})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "recompute each decoder layer in "
                                                "backward: keeps only the layers' inputs for backward, at the cost of "
                                                "a second forward. Default: off on a CUDA GPU where every layer's "
                                                "activations (estimated) fit in half of the memory free after loading "
                                                "the model, else on"})
    offload_activations: bool | None = field(default=None, metadata={"help": "with checkpointing: keep the "
                                             "layer inputs in pinned CPU memory, copied out and back on a side stream "
                                             "beside the compute, and with them, where the host has room and the "
                                             "layer's work hides the copies, each layer's attention and o outputs, "
                                             "which backward then does not recompute (model/offload.py)"})
    kernels: bool | None = field(default=None, metadata={"help": "Triton kernels (default: on with CUDA); "
                                 "--no-kernels runs the torch references"})
    cuda_graphs: str = field(default="auto", metadata={"choices": ("auto", "on", "off"), "help": "replay each "
                             "micro-step from a CUDA graph (step.py), which removes the per-step CPU cost of issuing "
                             "its kernels. auto: on with one CUDA GPU (QLoRA and LoRA dropout included). Padded "
                             "batches are padded further to a multiple of 64 tokens, and the count of documents up to "
                             "a power of two (one graph per such bucket): at most 63 extra padding tokens per row, "
                             "which nothing attends to or predicts. In a run of at most 100 micro-steps, rows "
                             "of at most 64 tokens are padded to 128: one graph fewer"})
    fp8: bool = field(default=False, metadata={"help": "the frozen base projections' forward and input-gradient "
                      "GEMMs on FP8 tensor cores (e4m3, a scale per row; docs/usage.md); LoRA and the rest stay "
                      "in bf16. Needs a GPU of compute capability 8.9+ (Ada, Hopper)"})
    loss_scale: float = field(default=2.0 ** 16, metadata={"help": "fp16: initial dynamic loss scale"})
    scale_growth_interval: int = field(default=200, metadata={"help": "fp16: double the scale after this many good "
                                       "steps"})
    max_skipped_steps: int = field(default=20, metadata={"help": "fp16: stop after this many inf/NaN steps in a row"})
    # --- eval, logging, checkpoints ---
    out_dir: str = field(default="out", metadata={"help": "run folder: metrics.jsonl, checkpoints/, adapter/"})
    eval_every: int = field(default=20, metadata={"help": "evaluate every N steps (0: only at the end)"})
    eval_batches: int | None = field(default=None, metadata={"help": "at most this many eval batches"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many checkpoints to keep, the newest (0: keep "
                                  "all)"})
    log_every: int = field(default=1, metadata={"help": "print a progress line every N steps (on a terminal: the "
                                                          "progress bar's loss and tok/s)"})
    resume: str | None = field(default=None, metadata={"help": "a checkpoint folder, or 'auto': the newest in out_dir "
                                                               "(none there: a new run)"})
    resume_anyway: bool = field(default=False, metadata={"help": "with --resume: continue even if options that decide "
                                "the trajectory (batch size, grad accum, max steps, the lr schedule, seed, packing, "
                                "max len, dropout, the data) differ from the checkpoint's; the run then differs from "
                                "an uninterrupted one"})
    overwrite: bool = field(default=False, metadata={"help": "reuse an out_dir that holds a previous run"})
    device: str = field(default="auto", metadata={"help": "auto: cuda, then mps, then cpu. mps (Apple silicon) runs "
                                                  "the torch references and is untested here",
                                                  "choices": ("auto", "cpu", "cuda", "cuda:N", "mps")})
    report_to: str = field(default="none", metadata={"help": "none, or trackers that also get metrics.jsonl's records, "
                           "comma-separated: tensorboard, wandb, trackio (optional extras: pip install -e "
                           "\".[tensorboard]\" etc.)"})
    push_to_hub: str | None = field(default=None, metadata={"help": "at the end, upload the adapter (with its model "
                                    "card) to this hub model repo, user/name; needs `hf auth login` or HF_TOKEN"})
    # --- experience ---
    num_epochs: float | None = field(default=None, metadata={"help": "train this many passes over the data (1.5 is "
                                     "fine) instead of --max-steps: steps = ceil(epochs x batches per epoch / grad "
                                     "accum)"})
    sample_every: int = field(default=-1, metadata={"help": "generate answers to 3 held-out prompts (greedy) every N "
                              "steps and at the end, logged with metrics.jsonl; -1: only before training and at the "
                              "end; 0: never"})

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
            (self.lora_alpha > 0, f"--lora-alpha must be > 0 (the update is scaled by alpha / r), "
                                  f"got {self.lora_alpha}"),
            (self.lora_plus_ratio > 0, f"--lora-plus-ratio must be > 0 (B's lr is lr times it), got "
                                       f"{self.lora_plus_ratio}"),
            (self.lora_init not in BASE_MOVING_INITS or not self.quantize, f"--lora-init {self.lora_init} with "
             f"--quantize {self.quantize}: {self.lora_init} moves its init out of the base weight, which must be "
             f"quantized after that, but NF4 weights are quantized as they load. Train {self.lora_init} on the "
             f"full-precision base (leave out --quantize), or use --lora-init default or gaussian with NF4"),
            (not (self.dora and self.lora_init in BASE_MOVING_INITS), f"--dora with --lora-init {self.lora_init}: "
             f"a {self.lora_init} adapter is saved as a plain LoRA, which has no DoRA magnitude; pass one of them"),
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
            (self.beta is None or self.beta > 0, f"--beta must be > 0, got {self.beta}"),
            (0 <= self.label_smoothing < 0.5, f"--label-smoothing must be at least 0 and below 0.5 (the share of "
                                              f"pairs assumed mislabeled), got {self.label_smoothing}"),
            (self.orpo_lambda >= 0, f"--orpo-lambda must be >= 0, got {self.orpo_lambda}"),
            (self.method == "sft" or not self.train_on_inputs, f"--train-on-inputs trains prompts, and --method "
             f"{self.method} compares the answers of a pair after the same prompt: drop --train-on-inputs"),
            (not self.precompute_ref or self.method in ("dpo", "ipo"), f"--precompute-ref computes the reference "
             f"model's log-probabilities of --method dpo or ipo; --method {self.method} has no reference model: drop "
             "--precompute-ref"),
            (self.full or self.train_modules is None, "--train-modules chooses the weights of --full: add --full"),
            (not (self.full and self.quantize), "--full trains the model's own weights, which --quantize nf4 freezes "
                                                "in 4 bits: drop one of them (QLoRA is LoRA on an NF4 base)"),
            (not (self.full and self.lora_options()), f"--full trains the model's own weights, without adapters: "
             f"drop the LoRA option(s) {', '.join(map(flag, self.lora_options()))}, or --full"),
            (not (self.full and self.method in ("dpo", "ipo")), f"--method {self.method} compares the model with "
             "itself before training, which LoRA gets by turning its adapters off; --full has no such copy. Use "
             "--method simpo or orpo (no reference model), or LoRA"),
            (not (self.full and self.fp8), "--fp8 runs the frozen base weights' GEMMs in fp8, and --full trains "
                                           "them: drop one of them"),
            (self.dtype in ("auto", "bf16") or not self.fp8, f"--fp8 runs beside bf16 (its GEMMs write bf16): use "
                                                              f"--dtype bf16 or auto, not {self.dtype}"),
            (self.sample_every >= -1, f"--sample-every must be a number of steps, -1 (only before training and at "
                                      f"the end) or 0 (never), got {self.sample_every}"),
        ]
        for holds, error in checks:
            if not holds:
                raise UserError(error)
        for name in ("quantize", "dtype", "cuda_graphs", "method", "lora_init"):
            value = getattr(self, name)
            if value is not None and value not in choices_of(name):
                optional = " (or left out)" if value_kinds(name)[1] else ""
                raise UserError(f"{flag(name)} must be one of {', '.join(choices_of(name))}{optional}, "
                                f"got {short(value)}")
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
            if self.train_modules is not None:
                parse_train_modules(self.train_modules)
            check_quantize(self.quantize)
            self.new_tokens()
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

    def objective(self, device="cpu"):
        """The preference loss of --method (a preference.Objective) on `device`, or None for sft (train.py's
        loss_fn)."""
        if self.method == "sft":
            return None
        return Objective(self.method, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.simpo_gamma,
                         lam=self.orpo_lambda, device=device)

    def lora_options(self) -> list[str]:
        """The LoRA options set away from their defaults."""
        return [n for n in OPTION_GROUPS["LoRA"] if getattr(self, n) != config_field(n).default]

    def new_tokens(self) -> list[str]:
        """The tokens of --add-tokens."""
        return parse_tokens(self.add_tokens)

    def lora(self) -> LoRAConfig | None:
        """The adapters' config; None with --full (no adapters)."""
        if self.full:
            return None
        return LoRAConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=tuple(t for t in self.lora_targets.split(",") if t), rslora=self.rslora,
                          dora=self.dora, init=self.lora_init)


# ----------------------------------------------------------------------------- options


def flag(name):
    """The command-line flag of a TrainConfig field: max_len -> --max-len."""
    return "--" + name.replace("_", "-")


def config_field(name, cls=None):
    """The dataclass field `name` of TrainConfig, or of `cls` (rl.py's RLConfig, a subclass)."""
    return next(f for f in dataclasses.fields(cls or TrainConfig) if f.name == name)


def choices_of(name):
    """The values a field takes, from its metadata (what --help lists and __post_init__ checks)."""
    return config_field(name).metadata["choices"]


def value_kinds(name, cls=None):
    """(the field's type: bool, int, float or str; whether it may be None)."""
    f = config_field(name, cls)
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


# --help lists the options in these groups, in this order; every TrainConfig field is in one of them.
OPTION_GROUPS = {
    "model": ("model", "tokenizer", "quantize"),
    "data": ("data", "eval_data", "eval_fraction", "max_examples", "columns", "chat_template", "system_prompt",
             "max_len", "packing", "train_on_inputs", "num_proc"),
    "LoRA": ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "rslora", "dora", "lora_plus_ratio",
             "lora_init", "train_embeddings", "add_tokens"),
    "full fine-tuning": ("full", "train_modules"),
    "training": ("method", "max_steps", "num_epochs", "batch_size", "grad_accum", "lr", "min_lr_ratio",
                 "warmup_steps", "weight_decay", "grad_clip", "seed", "device", "beta", "label_smoothing",
                 "simpo_gamma", "orpo_lambda", "precompute_ref"),
    "precision and memory": ("dtype", "gradient_checkpointing", "offload_activations", "loss_scale",
                             "scale_growth_interval", "max_skipped_steps"),
    "run folder": ("out_dir", "save_every", "keep_checkpoints", "resume", "resume_anyway", "overwrite",
                   "push_to_hub"),
    "logging and evaluation": ("log_every", "eval_every", "eval_batches", "sample_every", "report_to"),
    "GPU only": ("kernels", "cuda_graphs", "fp8"),
}


def build_parser(defaults=True, cls=None, groups=None, usage=USAGE):
    """The command line of TrainConfig (or of `cls`, with its --help `groups`; a field in no group is not an
    option there), plus --config. defaults=False: the options not given stay out of the parsed namespace, which
    then holds only what the command line says."""
    cls, option_groups = cls or TrainConfig, groups or OPTION_GROUPS
    p = argparse.ArgumentParser(description=usage, formatter_class=HelpFormatter,
                                argument_default=None if defaults else argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="read options from a .yaml or .json file "
                   "(docs/example-config.yaml; a run's train_config.json repeats that run); options on the command "
                   "line override it. "
                   f"{', '.join(map(flag, FOLDER_ACTIONS))} come from the command line only")
    groups = {}  # field name -> its --help group
    for title, names in option_groups.items():
        group = p.add_argument_group(title)
        groups.update(dict.fromkeys(names, group))
    for f in dataclasses.fields(cls):
        if f.name not in groups:
            continue
        kind, _ = value_kinds(f.name, cls)
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices and not f.metadata.get("separator") else None
        default = f.default if defaults else argparse.SUPPRESS
        if kind is bool:
            groups[f.name].add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                        help=option_help(f))
        elif f.metadata.get("repeatable"):  # given several times: one comma-separated value (parse_args)
            groups[f.name].add_argument(flag(f.name), type=kind, action="append", default=default, metavar=metavar,
                                        help=option_help(f))
        else:
            groups[f.name].add_argument(flag(f.name), type=kind, default=default, metavar=metavar, help=option_help(f))
    return p


def parse_args(argv=None, cls=None, groups=None, usage=USAGE) -> TrainConfig:
    """The TrainConfig (or `cls`, with its --help `groups`: see build_parser) of a command line: --config's file,
    then the options given on the command line over it. Of --max-steps and --num-epochs, one given on the command
    line replaces both of the file's."""
    cls = cls or TrainConfig
    config = build_parser(True, cls, groups, usage).parse_args(argv).config  # also --help, and argparse's errors
    given = vars(build_parser(False, cls, groups, usage).parse_args(argv))  # only what the command line says
    given.pop("config", None)
    given = {k: ",".join(v) if isinstance(v, list) else v for k, v in given.items()}  # a repeatable option's values
    values = read_config_file(config, cls) if config else {}
    if given.keys() & {"max_steps", "num_epochs"}:
        values.pop("max_steps", None)
        values.pop("num_epochs", None)
    return cls(**{**values, **given})


# What to do with a run folder that holds a run: asked on the command line each time, never taken from a
# config file (a run's train_config.json records them; passed back, its overwrite: true would replace the run).
FOLDER_ACTIONS = ("resume", "resume_anyway", "overwrite")


def read_config_file(path, cls=None):
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
    names = {f.name for f in dataclasses.fields(cls or TrainConfig)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise UserError(f"--config {path}: unknown option {short(key)}; the options are those of train.py --help, "
                            "written max_len or max-len")
        if name not in FOLDER_ACTIONS:
            values[name] = config_value(name, value, f"--config {path}: {key}", cls)
    return values


def config_value(name, value, where, cls=None):
    """`value` (from a config file) as field `name` (of TrainConfig, or `cls`) takes it: bool, int, float or str,
    or None where the field may be None. A number written as a string ("2e-4", which YAML reads as one) is
    converted."""
    kind, optional = value_kinds(name, cls)
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
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 2, 4, 4, 4, 4
    r.maxstring, r.maxother, r.maxlong = 60, 60, 40
    return r.repr(value)



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
    if cfg.fp8 and not (name.startswith("cuda") and torch.cuda.get_device_capability(name) >= (8, 9)):
        where = f"{torch.cuda.get_device_name(name)}, compute capability " \
                f"{'.'.join(map(str, torch.cuda.get_device_capability(name)))}" if name.startswith("cuda") else name
        raise UserError(f"--fp8 needs a CUDA GPU of compute capability 8.9 or more (Ada, Hopper: FP8 tensor cores); "
                        f"this run is on {where}. Leave out --fp8")
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



def run_length(cfg, batches_per_epoch):
    """(the run's optimizer steps, the header lines that say so): --max-steps, or --num-epochs passes over the
    data. A warning line when the warm-up takes the whole run."""
    max_steps = cfg.max_steps
    given = ""
    if cfg.num_epochs is not None:
        max_steps = max(1, math.ceil(cfg.num_epochs * batches_per_epoch / cfg.grad_accum))
        given = f" (--num-epochs {cfg.num_epochs:g})"
    epochs = max_steps * cfg.grad_accum / batches_per_epoch
    lines = [f"training {max_steps} steps: {epochs:.3g} epochs of {batches_per_epoch} batches{given}, "
             f"{cfg.grad_accum} micro-batch(es) per step"]
    if cfg.warmup_steps >= max_steps:
        lines.append(f"warning: --warmup-steps {cfg.warmup_steps} is not below the run's {max_steps} steps: the "
                     f"learning rate never reaches --lr {cfg.lr:g} and the cosine decay never starts; lower "
                     "--warmup-steps")
    return max_steps, lines


def check_model_fit(cfg, mcfg, tokenizer=None):
    """The tokenizer, --max-len and --train-modules against the model's config."""
    if cfg.full:
        try:
            train_filter(cfg.train_modules, mcfg)
        except ValueError as e:
            raise UserError(str(e)) from e
    if tokenizer is not None and tokenizer.vocab_size > mcfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
                        f"{mcfg.vocab_size} rows: they do not belong together. Use the tokenizer of this model")
    if cfg.max_len > mcfg.max_position_embeddings:
        raise UserError(f"--max-len {cfg.max_len} is longer than this model's context of "
                        f"{mcfg.max_position_embeddings} tokens (max_position_embeddings in its config): positions "
                        f"past it were never trained, and memory grows with the length. Use --max-len "
                        f"{mcfg.max_position_embeddings} or less")
