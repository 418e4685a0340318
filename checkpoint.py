"""The run folder and its checkpoints (nanochat's checkpoint_manager.py is the model).

    with RunFolder(cfg, rank, world) as run:  # leaving it closes metrics.jsonl
        run.check()                           # before any long work: writes nothing
        ck = run.find()                       # the checkpoint --resume names, read and checked (None: a new run)
        step = run.restore(ck, model, optimizer, scaler, batches)
        run.open(step)                        # clear (--overwrite) or trim (--resume) the folder, train_config.json
        run.save(step, model, optimizer, scaler, batches); run.log(record); run.save_adapter(model)

A run folder (--out-dir) holds `train_config.json`, `metrics.jsonl` (one JSON record per line),
`checkpoints/step-NNNNNNN/` ({state.pt, adapter/}) and, at the end, `adapter/`.
"""
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from model.adapters import save_adapter
from model.lora import lora_parameters


class UserError(Exception):
    """Bad input, or a run-folder problem the user must fix: printed as one line, no traceback."""


# What a checkpoint's state.pt holds: save() writes these keys, find() checks for them.
CHECKPOINT_KEYS = frozenset({"step", "config", "world_size", "lora", "optimizer", "state", "data", "rng"})
# Options that decide what the saved weights are: a checkpoint cannot continue under other values.
IDENTITY = ("model", "quantize", "lora_r", "lora_alpha", "lora_targets", "rslora")


def rng_state():
    """Every random stream the loop draws from (dropout): torch's CPU and CUDA generators and Python's."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def nearest_existing(path):
    """`path`, or its closest ancestor that exists: where a folder not yet created will live."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


class RunFolder:
    """The run folder of one training run. Every rank builds one and reads checkpoints through it; only rank 0
    writes."""

    def __init__(self, cfg, rank=0, world=1):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.root = os.path.join(cfg.out_dir, "checkpoints")
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.last, self.saved_step = None, 0  # the newest checkpoint written or resumed from, and its step
        self._metrics = None
        self.say = print if rank == 0 else (lambda *a, **k: None)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    # ------------------------------------------------------------------------- before the long work

    def check(self):
        """Refuse a folder that holds a run without --resume/--overwrite, and one that cannot be written.
        Writes nothing."""
        has_run = os.path.isdir(self.cfg.out_dir) and any(
            os.path.exists(os.path.join(self.cfg.out_dir, f)) for f in ("metrics.jsonl", "checkpoints", "train_config.json"))
        if has_run and not (self.cfg.overwrite or self.cfg.resume):
            raise UserError(f"{self.cfg.out_dir!r} already holds a run. Pass --resume auto to continue it, --overwrite "
                            "to replace it, or choose another --out-dir")
        where = nearest_existing(self.cfg.out_dir)
        try:  # os.access says yes to root even on a read-only mount: try for real (an unnamed file, gone on close)
            tempfile.TemporaryFile(dir=where).close()
        except OSError as e:
            raise UserError(f"cannot write to --out-dir {self.cfg.out_dir!r} ({e.strerror}: {where!r}); choose a "
                            "writable folder") from e

    def check_free_disk(self, model):
        need = 3 * sum(p.numel() * 4 for _, p in lora_parameters(model)) + (64 << 20)  # weights + 2 Adam moments
        free = shutil.disk_usage(nearest_existing(self.cfg.out_dir)).free
        if free < 2 * need:
            raise UserError(f"only {free / 2**20:.0f} MiB free in {self.cfg.out_dir!r}, a checkpoint needs about "
                            f"{need / 2**20:.0f} MiB (twice that while the previous one is kept); free space or use "
                            "another --out-dir")

    # ------------------------------------------------------------------------- finding a checkpoint

    def checkpoints(self):
        """The complete checkpoints, oldest first."""
        if not os.path.isdir(self.root):
            return []
        steps = sorted(d for d in os.listdir(self.root) if d.startswith("step-") and not d.endswith(".tmp"))  # .tmp: incomplete
        return [os.path.join(self.root, d) for d in steps]

    def find(self):
        """The checkpoint that --resume names (None without --resume), read and checked against this run before
        any long work; a checkpoint that cannot be read is skipped, with a warning, for the one before it."""
        if not self.cfg.resume:
            return None
        candidates = self.checkpoints()[::-1] if self.cfg.resume == "auto" else [self.cfg.resume]
        candidates = [p for p in candidates if os.path.isfile(os.path.join(p, "state.pt"))]
        if not candidates:
            where = self.root + "/step-*" if self.cfg.resume == "auto" else self.cfg.resume
            raise UserError(f"--resume {self.cfg.resume}: no checkpoint found (looked for {where}/state.pt)")
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
            raise UserError(f"--resume {self.cfg.resume}: no readable checkpoint: {'; '.join(damaged)}. Checkpoints "
                            "are written atomically, so something changed these files afterwards. Delete them and "
                            "resume from an earlier one (--resume PATH), or start again in a new --out-dir")
        old = ck["config"]
        for key in IDENTITY:
            if old[key] != getattr(self.cfg, key):
                raise UserError(f"--resume {path}: the checkpoint was trained with {key}={old[key]!r}, this run has "
                                f"{getattr(self.cfg, key)!r}. Resume with the same model and LoRA settings, or start "
                                "a new --out-dir")
        if ck["world_size"] != self.world:
            raise UserError(f"--resume {path}: the checkpoint was written by {ck['world_size']} process(es), this "
                            f"run has {self.world}. Resume with the same number (torchrun --nproc_per_node="
                            f"{ck['world_size']}): each process continues its own share of the data")
        return {**ck, "path": path}

    def restore(self, ck, model, optimizer, scaler, batches):
        """Load checkpoint `ck` (from find) into the run and return its step; 0 for None (a new run)."""
        if ck is None:
            return 0
        params = dict(lora_parameters(model))
        with torch.no_grad():
            for n, t in ck["lora"].items():
                params[n].copy_(t)
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["state"])
        batches.load_state_dict(ck["data"])
        set_rng_state(ck["rng"][self.rank])
        self.last, self.saved_step = ck["path"], ck["step"]  # never re-save the checkpoint we start from
        self.say(f"resumed from {ck['path']} at step {ck['step']}")
        return ck["step"]

    # ------------------------------------------------------------------------- writing

    def open(self, step):
        """Create the folder (rank 0, once every check has passed). --overwrite clears the previous run, so a
        later --resume auto cannot pick up its checkpoints; --resume drops the metrics past the checkpoint at
        `step`, which the resumed run writes again (its train records after `step`, its evals from `step` on)."""
        if self.rank != 0:
            return
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        if self.cfg.resume and os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                records = [json.loads(line) for line in f if line.endswith("\n")]  # a line cut by a kill has no \n
            keep = [r for r in records if r["step"] < step or (r["step"] == step and "loss" in r)]
            with open(self.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
        elif self.cfg.overwrite:
            for name in ("metrics.jsonl", "checkpoints", "adapter"):
                path = os.path.join(self.cfg.out_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        with open(os.path.join(self.cfg.out_dir, "train_config.json"), "w") as f:
            json.dump(dataclasses.asdict(self.cfg), f, indent=2)
        self._metrics = open(self.metrics_path, "a")

    def log(self, record):
        """Append one record to metrics.jsonl (rank 0), flushed, so that a crash loses at most the line being written."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def next_steps(self, fix):
        """How to go on after the run stopped on NaN/inf: `fix`, then continue from the last good checkpoint."""
        if self.last is None:
            return f"No checkpoint was saved yet: {fix} and start again"
        return f"The last good checkpoint is {self.last}: {fix} and continue from it with --resume {self.last}"

    def save(self, step, model, optimizer, scaler, batches):
        """Write everything a resume needs into a temp folder, then rename it into place (atomic): a save that
        is interrupted leaves only a stray *.tmp folder and every earlier checkpoint intact. Every rank calls it
        (each sends its RNG state); rank 0 writes. Returns the path on every rank."""
        rngs = [rng_state()] * self.world
        if self.world > 1:  # each rank's own dropout stream, so a resume continues every one of them exactly
            dist.all_gather_object(rngs, rngs[0])
        final = os.path.join(self.root, f"step-{step:07d}")
        if self.rank == 0:
            self._write(final, step, model, optimizer, scaler, batches, rngs)
        self.last, self.saved_step = final, step
        return final

    def _write(self, final, step, model, optimizer, scaler, batches, rngs):
        os.makedirs(self.root, exist_ok=True)
        for d in os.listdir(self.root):
            if d.endswith(".tmp"):  # left by a save that was killed: incomplete, never read
                shutil.rmtree(os.path.join(self.root, d))
        tmp = final + ".tmp"
        try:
            os.makedirs(tmp)  # the folder name says it is incomplete until the rename below
            ck = {
                "step": step,
                "config": dataclasses.asdict(self.cfg),
                "world_size": self.world,
                "lora": {n: p.detach().cpu() for n, p in lora_parameters(model)},
                "optimizer": optimizer.state_dict(),
                "state": scaler.state_dict(),  # loss scale, good-step counter
                "data": batches.state_dict(),  # the same on every rank: they step together
                "rng": rngs,  # one per rank
            }
            assert ck.keys() == CHECKPOINT_KEYS, "CHECKPOINT_KEYS must name what a checkpoint holds"
            torch.save(ck, os.path.join(tmp, "state.pt"))
            save_adapter(model, os.path.join(tmp, "adapter"), base_model=self.cfg.model)
        except (OSError, RuntimeError) as e:  # disk full, quota, permissions (torch.save raises RuntimeError)
            shutil.rmtree(tmp, ignore_errors=True)
            earlier = self.checkpoints()
            keep = (f"the last good checkpoint is {earlier[-1]}: continue from it with --resume auto once there is "
                    "room" if earlier else "no earlier checkpoint exists")
            raise UserError(f"cannot write checkpoint {final} ({e}). Free disk space in {self.cfg.out_dir} (or check "
                            f"its quota and permissions); {keep}") from e
        if os.path.isdir(final):  # the same step saved again (a run resumed from an older checkpoint): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for path in self.checkpoints()[:-self.cfg.keep_checkpoints]:
            shutil.rmtree(path, ignore_errors=True)

    def save_adapter(self, model):
        """The run's result, out/adapter/ in PEFT's format (rank 0). Returns its path."""
        folder = os.path.join(self.cfg.out_dir, "adapter")
        if self.rank == 0:
            save_adapter(model, folder, base_model=self.cfg.model)
        return folder

    def close(self):
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
