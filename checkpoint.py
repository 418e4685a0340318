"""Checkpoints: save, find, verify, restore (nanochat's checkpoint_manager.py is the model).

    ckpts = Checkpoints(cfg, rank, world, warn)
    ck = ckpts.find(data_hash, eval_hash)    # the checkpoint --resume names, verified (None: a new run)
    step = ckpts.restore(ck, model, optimizer, scaler, batches)
    ckpts.save(step, model, optimizer, scaler, batches); ckpts.save_result(model)

A checkpoint is `--out-dir/checkpoints/step-NNNNNNN/`: state.json and tensors.safetensors (statefiles.py), the
adapter in PEFT's format (not with --full: the trained weights are in tensors.safetensors), and manifest.json.
Its trained weights (the `lora` entry) are those the optimizer steps, by name: the LoRA weights, or with --full
the fp32 master of every trained weight (masters.py), from which a resume rounds the model's weights again.
It is written into step-N.tmp/ and renamed into place, so an interrupted save leaves every earlier checkpoint
whole. What is guaranteed, and the tests: docs/reliability.md.
"""
import dataclasses
import os
import re
import shutil
import tempfile
import time

import torch
from safetensors import SafetensorError

from config import UserError, config_field
from distributed import gather
from model.adapters import ADAPTER_CONFIG, merge_and_save, save_adapter
from model.files import remove_tree
from model.hub import base_model_id, model_card, resolve
from model.weights import trainable_parameters
from runlog import nearest_existing
from statefiles import (
    CHECKPOINT_KEYS,
    LEGACY_STATE,
    STATE,
    Damaged,
    check_manifest,
    read_state,
    rng_state,
    set_rng_state,
    write_manifest,
    write_state,
)

# Options that decide what the saved weights are: a checkpoint cannot continue under other values.
IDENTITY = ("model", "quantize", "lora_r", "lora_alpha", "lora_targets", "rslora", "dora", "lora_init",
            "lora_plus_ratio", "train_embeddings", "add_tokens", "full", "train_modules")
# Options that, with the tokenized data and the process count, decide the rest of the trajectory: a resume
# under other values does not reproduce the uninterrupted run, so it needs --resume-anyway.
TRAJECTORY = ("batch_size", "grad_accum", "max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
              "grad_clip", "seed", "packing", "max_len", "train_on_inputs", "lora_dropout", "method", "beta",
              "label_smoothing", "simpo_gamma", "orpo_lambda")
# The options an adapter's model card lists: those that decide what was trained, and how.
CARD_OPTIONS = ("method", "max_steps", "batch_size", "grad_accum", "max_len", "packing", "train_on_inputs", "lr",
                "warmup_steps", "lora_dropout", "rslora", "dora", "lora_plus_ratio", "lora_init", "dtype", "seed")
# What a failed write raises: OSError (open, write), SafetensorError (the tensors), ValueError (the adapter's
# folder: model.files.write_error's one line for a full or read-only disk).
WRITE_ERRORS = (OSError, SafetensorError, ValueError)


def same_model(a, b):
    """Two --model strings name the same model when they differ only in spelling of the path (a trailing /, ./)."""
    return a == b or os.path.normpath(a) == os.path.normpath(b)


def trained_weights(model, optimizer):
    """(name, tensor) of the weights the optimizer steps, by the names its groups carry (masters.py,
    `param_groups`): the LoRA weights and embeddings themselves, and the fp32 masters of --full's weights."""
    named = [(n, p) for group in optimizer.param_groups for n, p in zip(group["param_names"], group["params"])]
    assert sorted(n for n, _ in named) == sorted(n for n, _ in trainable_parameters(model)), \
        "the optimizer steps the trainable weights"
    return named


def nonfinite(model, optimizer=None):
    """The names of the trained weights (and of their optimizer states) that hold NaN or inf: the optimizer's
    (`trained_weights`), or without it the model's."""
    tensors = []
    for name, p in trained_weights(model, optimizer) if optimizer is not None else trainable_parameters(model):
        tensors.append((name, p))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors += [(f"{name} (optimizer {k})", v) for k, v in state.items() if torch.is_tensor(v)]
    return [name for name, t in tensors if not bool(torch.isfinite(t).all())]


def lora_mismatch(lora, model):
    """What differs between a checkpoint's trained tensors and the model's trainable ones ('' when they fit)."""
    want = {n: tuple(p.shape) for n, p in trainable_parameters(model)}
    have = {n: tuple(t.shape) for n, t in lora.items()}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    shapes = [f"{n} {have[n]} (the model's is {want[n]})" for n in sorted(want.keys() & have.keys())
              if have[n] != want[n]]
    parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
             f"shape of {shapes[0]}" if shapes else ""]
    return ", ".join(p for p in parts if p)



class Checkpoints:
    """The checkpoints of one run. Every rank builds one and reads checkpoints through it; only rank 0 writes."""

    def __init__(self, cfg, rank=0, world=1, warn=None, tokenizer=None):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.tokenizer = tokenizer  # saved with each adapter: one that gained tokens (--add-tokens), else None
        self.root = os.path.join(cfg.out_dir, "checkpoints")
        self.last, self.saved_step = None, 0  # the newest checkpoint written or resumed from, and its step
        self.data_hash, self.eval_hash, self._candidates, self._damaged = None, None, iter(()), []
        self.warn = warn or (lambda message: None)
        self.say = print if rank == 0 else (lambda *a, **k: None)

    def check_free_disk(self, model):
        need = 3 * sum(p.numel() * 4 for _, p in trainable_parameters(model)) + (64 << 20)  # weights + 2 Adam moments
        free = shutil.disk_usage(nearest_existing(self.cfg.out_dir)).free
        if free < 2 * need:
            raise UserError(f"only {free / 2**20:.0f} MiB free in {self.cfg.out_dir!r}, a checkpoint needs about "
                            f"{need / 2**20:.0f} MiB (twice that while the previous one is kept); free space or use "
                            "another --out-dir")

    def list(self):
        """The checkpoint folders, oldest first: folders named exactly step-N (not a *.tmp save that did not
        finish, not a user's step-N-backup copy, not a link), the ones that resuming reads and rotation deletes."""
        if not os.path.isdir(self.root):
            return []
        steps = sorted((int(d[5:]), d) for d in os.listdir(self.root) if re.fullmatch(r"step-\d+", d)
                       and not os.path.islink(os.path.join(self.root, d)))
        return [os.path.join(self.root, d) for _, d in steps]

    def find(self, data_hash, eval_hash=None):
        """The checkpoint --resume names, verified (sha256 manifest, keys, finite weights) and checked against
        this run (the tokenized training data has the sha256 `data_hash`) before any long work; a damaged one
        is skipped, with a warning, for the one before it. None without --resume, and when --resume auto finds
        no checkpoint: the run starts from step 0."""
        self.data_hash, self.eval_hash = data_hash, eval_hash
        if not self.cfg.resume:
            return None
        auto = self.cfg.resume == "auto"
        paths = self.list()[::-1] if auto else [self.cfg.resume]
        if auto and not paths:
            self.say(f"--resume auto: no checkpoint in {self.root}; starting a new run")
            return None
        self._candidates = self._readable(paths)
        return self._next()

    def _readable(self, paths):
        """The checkpoints of `paths` (newest first) that can be read, each with its path."""
        for path in paths:
            if not os.path.isdir(path):  # --resume PATH that does not exist: no checkpoint found
                continue
            try:
                if not any(os.path.isfile(os.path.join(path, f)) for f in (STATE, LEGACY_STATE)):
                    raise Damaged(f"no {STATE}")
                check_manifest(path)
                ck = read_state(path)
                bad = [n for n, t in ck["lora"].items() if not bool(torch.isfinite(t).all())]
                if bad:
                    raise Damaged(f"its LoRA weights hold NaN/inf ({bad[0]})")
            except Exception as e:  # Damaged, or any parse error of a file changed after its manifest
                self._skip(path, e)
                continue
            yield {**ck, "path": path}

    def _skip(self, path, e):
        self._damaged.append(f"{path} ({type(e).__name__}: {str(e)[:160]})")
        self.warn(f"cannot read checkpoint {self._damaged[-1]}; trying the one before it")


    def _next(self):
        """The next readable checkpoint, checked against this run: one of another model or LoRA shape, process
        count or (without --resume-anyway) trajectory is refused, not skipped: the options are what differs."""
        ck = next(self._candidates, None)
        if ck is None:
            where = self.root + "/step-*" if self.cfg.resume == "auto" else self.cfg.resume
            if not self._damaged:
                raise UserError(f"--resume {self.cfg.resume}: no checkpoint found (looked for {where}/{STATE})")
            raise UserError(f"--resume {self.cfg.resume}: no readable checkpoint: {'; '.join(self._damaged)}. "
                            "Checkpoints are written atomically, so something changed these files afterwards. Delete "
                            "them and resume from an earlier one (--resume PATH), or start again in a new --out-dir")
        old = {**{k: config_field(k).default for k in IDENTITY if k != "model"}, **ck["config"]}  # a newer option
        for key in IDENTITY:
            new = getattr(self.cfg, key)
            if not (same_model(old[key], new) if key == "model" else old[key] == new):
                raise UserError(f"--resume {ck['path']}: the checkpoint was trained with {key}={old[key]!r}, this run "
                                f"has {new!r}. Resume with the same model and LoRA settings, or start a new --out-dir")
        if ck["world_size"] != self.world:
            raise UserError(f"--resume {ck['path']}: the checkpoint was written by {ck['world_size']} process(es), "
                            f"this run has {self.world}. Resume with the same number (torchrun --nproc_per_node="
                            f"{ck['world_size']}): each process continues its own share of the data")
        old = {**{k: config_field(k).default for k in TRAJECTORY}, **old}  # an option newer than the checkpoint
        changed = [f"{k} {old[k]!r} -> {getattr(self.cfg, k)!r}" for k in TRAJECTORY if old[k] != getattr(self.cfg, k)]
        if ck["data_hash"] != self.data_hash:
            changed.append("the tokenized training data (--data, --eval-fraction, the tokenizer or --max-len)")
        if changed and not self.cfg.resume_anyway:
            raise UserError(f"--resume {ck['path']}: this run differs from the checkpoint's in {'; '.join(changed)}, "
                            "so it would not continue the same run. Use the checkpoint's options (its "
                            "train_config.json), or pass --resume-anyway to continue with the new ones")
        if changed:
            schedule = [k for k in ("lr", "max_steps", "warmup_steps", "min_lr_ratio")
                        if old[k] != getattr(self.cfg, k)]
            self.warn(f"--resume-anyway: continuing {ck['path']} with {'; '.join(changed)}" + (
                f". The learning-rate schedule is the new one's from step {ck['step']} on: it does not restart its "
                "warm-up, and the lr jumps to where the new schedule is at that step" if schedule else ""))
        if ck.get("eval_hash", self.eval_hash) != self.eval_hash:
            self.warn(f"--resume {ck['path']}: the eval data differs from the checkpoint's (--eval-data, "
                      "--eval-fraction or --max-len), so metrics.jsonl's eval_loss before and after this resume "
                      "measure two different eval sets")
        return ck

    def restore(self, ck, model, optimizer, scaler, batches):
        """Load checkpoint `ck` (from find) into the run and return its step; 0 for None (a new run). A checkpoint
        whose LoRA tensors do not fit the model is skipped, with a warning, for the one before it."""
        if ck is None:
            return 0
        while problem := lora_mismatch(ck["lora"], model):
            self._skip(ck["path"], Damaged(f"its LoRA tensors do not fit the model: {problem}"))
            ck = self._next()
        weights, masters = dict(trainable_parameters(model)), dict(trained_weights(model, optimizer))
        with torch.no_grad():
            for n, t in ck["lora"].items():
                masters[n].copy_(t)
                weights[n].copy_(t)  # the same tensor, or with --full the model's weight, rounded from its master
        scales = [g["lr_scale"] for g in optimizer.param_groups]
        optimizer.load_state_dict(ck["optimizer"])
        for g, s in zip(optimizer.param_groups, scales):  # a checkpoint from before LoRA+ has none; else the same
            g["lr_scale"] = s
        scaler.load_state_dict(ck["scaler"])
        if ck["data"]["rows"] == batches.n_rows:
            batches.load_state_dict(ck["data"])
        else:  # only with --resume-anyway (find() refuses other data): the position means nothing in other data
            self.warn(f"the data changed: it now makes {batches.n_rows} rows (the checkpoint's made "
                      f"{ck['data']['rows']}); reading it from its first batch")
        set_rng_state(ck["rng"][self.rank])
        self.last, self.saved_step = ck["path"], ck["step"]
        self.say(f"resumed from {ck['path']} at step {ck['step']}")
        return ck["step"]

    # ------------------------------------------------------------------------- writing


    def set_aside_newer(self, step):
        """Resuming from an older checkpoint: the newer ones belong to the abandoned run, and --resume auto must
        not pick them later. They move to checkpoints/abandoned-<time>/, not deleted."""
        newer = [p for p in self.list() if int(os.path.basename(p)[5:]) > step]
        if not newer:
            return
        dest = tempfile.mkdtemp(prefix=time.strftime("abandoned-%Y%m%d-%H%M%S-"), dir=self.root)
        for path in newer:
            os.rename(path, os.path.join(dest, os.path.basename(path)))
        names = ", ".join(os.path.basename(p) for p in newer)
        self.say(f"moved {len(newer)} newer checkpoint(s) ({names}) of the abandoned run to {dest}: this run "
                 f"continues from step {step}")


    def next_steps(self, fix):
        """How to go on after a failure: `fix`, then continue from the last good checkpoint."""
        if self.last is None:
            return f"No checkpoint was saved yet: {fix} and start again"
        return f"The last good checkpoint is {self.last}: {fix} and continue from it with --resume {self.last}"

    def save(self, step, model, optimizer, scaler, batches):
        """Write everything a resume needs into step-N.tmp/, a sha256 manifest of its files last, then rename it
        into place (atomic): an interrupted save leaves only a stray *.tmp folder, removed by the next save, and
        every earlier checkpoint intact. NaN/inf weights or optimizer state are never saved. Every rank calls it
        (each sends its RNG state); rank 0 writes. Returns the path."""
        final = os.path.join(self.root, f"step-{step:07d}")
        bad = nonfinite(model, optimizer)
        if bad:
            raise UserError(f"not saving checkpoint {final}: {', '.join(bad[:2])}{' ...' if len(bad) > 2 else ''} "
                            f"hold NaN/inf after step {step}. {self.next_steps('lower --lr (or check the data)')}")
        rngs = gather(rng_state(), self.world)  # each rank's own dropout stream: a resume continues every one
        if self.rank == 0:
            self._write(final, step, model, optimizer, scaler, batches, rngs)
        self.last, self.saved_step = final, step
        return final

    def _write(self, final, step, model, optimizer, scaler, batches, rngs):
        os.makedirs(self.root, exist_ok=True)
        for d in os.listdir(self.root):
            if re.fullmatch(r"step-\d+\.tmp", d):  # left by a save that was killed: incomplete, never read
                remove_tree(os.path.join(self.root, d))
        tmp = final + ".tmp"
        try:
            os.makedirs(tmp)  # the folder name says it is incomplete until the rename below
            ck = {
                "step": step,
                "config": dataclasses.asdict(self.cfg),
                "world_size": self.world,
                "data_hash": self.data_hash,  # the tokenized training data a resume must find again
                "eval_hash": self.eval_hash,  # the eval data: a resume on other eval data is said
                "lora": {n: p.detach().cpu() for n, p in trained_weights(model, optimizer)},
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),  # fp16 loss scale and good-step counter
                "data": batches.state_dict(),  # the same on every rank: they step together
                "rng": rngs,  # one per rank
            }
            assert ck.keys() == CHECKPOINT_KEYS, "CHECKPOINT_KEYS must name what a checkpoint holds"
            write_state(tmp, ck)
            if not self.cfg.full:
                save_adapter(model, os.path.join(tmp, "adapter"), base_model=self.cfg.model,
                             tokenizer=self.tokenizer)
            write_manifest(tmp)
        except WRITE_ERRORS as e:  # disk full, quota, permissions
            shutil.rmtree(tmp, ignore_errors=True)
            keep = (f"the last good checkpoint is {self.last}: continue from it with --resume auto once there is "
                    "room" if self.last else "no earlier checkpoint exists")
            raise UserError(f"cannot write checkpoint {final} ({e}). Free disk space in {self.cfg.out_dir} (or check "
                            f"its quota and permissions); {keep}") from e
        if os.path.lexists(final):  # the same step saved again (a checkpoint without its state): replace it
            remove_tree(final)
        os.replace(tmp, final)
        if self.cfg.keep_checkpoints:  # 0 keeps every checkpoint
            for path in self.list()[:-self.cfg.keep_checkpoints]:
                if path != final:
                    shutil.rmtree(path, ignore_errors=True)

    @property
    def result_folder(self):
        """out/adapter/ (PEFT's format), or with --full out/model/ (a Hugging Face model folder)."""
        return os.path.join(self.cfg.out_dir, "model" if self.cfg.full else "adapter")

    def result_done(self):
        """Whether the run's result (written at the end, after the final checkpoint) is in its folder."""
        return os.path.isfile(os.path.join(self.result_folder, "config.json" if self.cfg.full else ADAPTER_CONFIG))

    def save_result(self, model, metrics=None):
        """The run's result (rank 0), after the final checkpoint: the adapter in PEFT's format, or with --full the
        model as a Hugging Face folder (safetensors shards, config.json, the tokenizer's files) in the dtype it
        trained in, which transformers loads and scripts/export_gguf.py converts."""
        if self.rank != 0:
            return
        folder, what = self.result_folder, "model" if self.cfg.full else "adapter"
        bad = nonfinite(model)
        if bad:
            raise UserError(f"not writing the {what}: {bad[0]} holds NaN/inf. {self.next_steps('lower --lr')}")
        options = {k: getattr(self.cfg, k) for k in CARD_OPTIONS}
        try:
            if self.cfg.full:
                card = model_card(base_model_id(self.cfg.model), "finetune", library_name="transformers",
                                  dataset=self.cfg.data, metrics=metrics,
                                  options={**options, "trained weights": self.cfg.train_modules or "all"})
                merge_and_save(model, resolve(self.cfg.tokenizer or self.cfg.model), folder, card=card,
                               marker="config.json", tokenizer=self.tokenizer)
            else:
                save_adapter(model, folder, base_model=self.cfg.model, dataset=self.cfg.data, options=options,
                             metrics=metrics, tokenizer=self.tokenizer)
        except WRITE_ERRORS as e:
            kept = "its tensors.safetensors holds the trained weights" if self.cfg.full else \
                f"{self.last}/adapter is this adapter"
            raise UserError(f"cannot write the {what} to {folder} ({e}). Nothing is lost: the final checkpoint "
                            f"{self.last} holds the same weights, and {kept}") from e
        return folder

