"""The run folder and its checkpoints (nanochat's checkpoint_manager.py is the model).

    with RunFolder(cfg, rank, world) as run:  # leaving it closes metrics.jsonl and releases the lock
        run.check()                           # before any long work: writes nothing
        ck = run.find(fingerprint(train_examples))  # the checkpoint --resume names, verified (None: a new run)
        step = run.restore(ck, model, optimizer, scaler, batches)
        run.open(step)                        # lock, then clear (--overwrite) or trim (--resume), train_config.json
        run.save(step, model, optimizer, scaler, batches); run.log(record); run.save_adapter(model)

A run folder (--out-dir) holds `.lock`, `train_config.json`, `metrics.jsonl` (one strict-JSON record per
line), `checkpoints/step-NNNNNNN/` ({state.json, tensors.safetensors, adapter/, manifest.json}) and, at the end,
`adapter/`. A checkpoint holds no pickle: its tensors are safetensors, everything else JSON, so reading one that
someone else wrote runs none of their code.
What is guaranteed, and the tests that show it: docs/reliability.md.
"""
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import tracking
from model.adapters import ADAPTER_CONFIG, check_replaceable, save_adapter
from model.files import UnsafePath, atomic_file, check_writable_file, open_append, open_regular, remove_tree
from model.lora import lora_parameters


class UserError(Exception):
    """Bad input, or a run-folder problem the user must fix: printed as one line, no traceback."""


class Damaged(Exception):
    """A checkpoint that cannot be used: incomplete, changed after it was written, or not for this model."""


# What a checkpoint holds (state.json and tensors.safetensors together): save() writes these keys, find()
# checks for them.
CHECKPOINT_KEYS = frozenset({"step", "config", "world_size", "data_hash", "eval_hash", "lora", "optimizer", "scaler",
                             "data", "rng"})
# Options that decide what the saved weights are: a checkpoint cannot continue under other values.
IDENTITY = ("model", "quantize", "lora_r", "lora_alpha", "lora_targets", "rslora")
# Options that, with the tokenized data and the process count, decide the rest of the trajectory: a resume
# under other values does not reproduce the uninterrupted run, so it needs --resume-anyway.
TRAJECTORY = ("batch_size", "grad_accum", "max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
              "grad_clip", "seed", "packing", "max_len", "train_on_inputs", "lora_dropout")
MANIFEST = "manifest.json"
STATE, TENSORS = "state.json", "tensors.safetensors"
# A checkpoint written before checkpoints held no pickle. It is read with torch.load(weights_only=True), which
# unpickles tensors and plain containers only; torch >= 2.6 (pyproject's floor) closes that loader's known
# code-execution hole (CVE-2025-32434). This reader can go once no such checkpoint is left to resume.
LEGACY_STATE = "state.pt"
# What a failed write raises: OSError (open, write), SafetensorError (the tensors, the adapter).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def fingerprint(encoded):
    """sha256 of tokenized examples [(ids, loss mask), ...] in order: a resume checks it trains on the same data."""
    h = hashlib.sha256()
    for ids, mask in encoded:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(np.asarray(mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def same_model(a, b):
    """Two --model strings name the same model when they differ only in spelling of the path (a trailing /, ./)."""
    return a == b or os.path.normpath(a) == os.path.normpath(b)


def nonfinite(model, optimizer=None):
    """The names of the LoRA weights (and of their optimizer states) that hold NaN or inf."""
    tensors = []
    for name, p in lora_parameters(model):
        tensors.append((name, p))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors += [(f"{name} (optimizer {k})", v) for k, v in state.items() if torch.is_tensor(v)]
    return [name for name, t in tensors if not bool(torch.isfinite(t).all())]


def rng_state():
    """Every random stream the loop draws from (dropout): torch's CPU and CUDA generators and Python's."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]  # JSON gives lists where getstate() gave tuples
    random.setstate((version, tuple(internal), gauss))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def position(batches):
    """Where the run stands in its data and random streams; rewind() returns to it."""
    return batches.state_dict(), rng_state()


def rewind(batches, pos):
    batches.load_state_dict(pos[0])
    set_rng_state(pos[1])


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def state_parts(ck):
    """A checkpoint dict (CHECKPOINT_KEYS) as (JSON-able dict, {name: tensor}) for state.json and
    tensors.safetensors: every tensor goes to the second, under a name its place in the first gives."""
    tensors = {f"lora.{n}": t for n, t in ck["lora"].items()}
    opt_state = {}
    for i, (idx, st) in enumerate(ck["optimizer"]["state"].items()):
        opt_state[str(idx)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optimizer.{i}.{k}"] = v
                opt_state[str(idx)][k] = {"tensor": f"optimizer.{i}.{k}"}
            else:
                opt_state[str(idx)][k] = {"value": v}
    rngs = []
    for r, rng in enumerate(ck["rng"]):
        tensors[f"rng.{r}.torch"] = rng["torch"]
        cuda = rng["cuda"]
        for d, t in enumerate(cuda or []):
            tensors[f"rng.{r}.cuda.{d}"] = t
        rngs.append({"python": rng["python"], "cuda": None if cuda is None else len(cuda)})
    meta = {k: ck[k] for k in ("step", "config", "world_size", "data_hash", "eval_hash", "scaler", "data")}
    meta["optimizer"] = {"param_groups": ck["optimizer"]["param_groups"], "state": opt_state}
    meta["rng"] = rngs
    return meta, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def state_from_parts(meta, tensors):
    """The inverse of state_parts. Raises Damaged when a name that state.json gives has no tensor."""
    def tensor(name):
        if name not in tensors:
            raise Damaged(f"{TENSORS} has no tensor {name!r}, which {STATE} names")
        return tensors[name]

    missing = CHECKPOINT_KEYS - meta.keys() - {"lora", "eval_hash"}
    if missing:
        raise Damaged(f"not a nanotune checkpoint: {STATE} lacks {sorted(missing)}")
    state = {int(idx): {k: tensor(v["tensor"]) if "tensor" in v else v["value"] for k, v in st.items()}
             for idx, st in meta["optimizer"]["state"].items()}
    rngs = [{"torch": tensor(f"rng.{r}.torch"), "python": rng["python"],
             "cuda": None if rng["cuda"] is None else [tensor(f"rng.{r}.cuda.{d}") for d in range(rng["cuda"])]}
            for r, rng in enumerate(meta["rng"])]
    lora = {n[len("lora."):]: t for n, t in tensors.items() if n.startswith("lora.")}
    return {**meta, "lora": lora, "rng": rngs,
            "optimizer": {"state": state, "param_groups": meta["optimizer"]["param_groups"]}}


def write_state(folder, ck):
    """Write checkpoint dict `ck` into `folder` as state.json and tensors.safetensors."""
    meta, tensors = state_parts(ck)
    save_file(tensors, os.path.join(folder, TENSORS))
    with open(os.path.join(folder, STATE), "x") as f:
        json.dump(meta, f, indent=1, allow_nan=False)


def read_state(folder):
    """The checkpoint dict of `folder`, read without unpickling anything (a legacy state.pt: tensors and plain
    containers only). Raises Damaged when it is not a complete nanotune checkpoint."""
    if os.path.isfile(os.path.join(folder, STATE)):
        with open(os.path.join(folder, STATE)) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise Damaged(f"{STATE} is not a JSON object")
        ck = state_from_parts(meta, load_file(os.path.join(folder, TENSORS)))
    elif os.path.isfile(os.path.join(folder, LEGACY_STATE)):
        ck = torch.load(os.path.join(folder, LEGACY_STATE), map_location="cpu", weights_only=True)
    else:
        raise Damaged(f"no {STATE}")
    if not isinstance(ck, dict) or not CHECKPOINT_KEYS - {"eval_hash"} <= ck.keys():  # older ones lack eval_hash
        raise Damaged("not a nanotune checkpoint: keys missing")
    return ck


def write_manifest(folder):
    """manifest.json: the sha256 of every other file of `folder`, written after them."""
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    digests = {f: sha256_file(os.path.join(folder, f)) for f in files if f != MANIFEST}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"sha256": digests}, f, indent=1)


def check_manifest(folder):
    """Raises Damaged unless every file that manifest.json lists is there with its sha256, the state among them."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            digests = json.load(f)["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Damaged(f"no readable {MANIFEST} ({type(e).__name__}): the save did not finish") from e
    if not ({STATE, TENSORS} <= digests.keys() or LEGACY_STATE in digests):
        raise Damaged(f"{MANIFEST} does not list {STATE} and {TENSORS}")
    for name, digest in digests.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise Damaged(f"{name} is missing")
        if sha256_file(path) != digest:
            raise Damaged(f"{name} does not match its sha256 in {MANIFEST}: it changed after it was written")


def lora_mismatch(lora, model):
    """What differs between a checkpoint's LoRA tensors and the model's ('' when they fit)."""
    want = {n: tuple(p.shape) for n, p in lora_parameters(model)}
    have = {n: tuple(t.shape) for n, t in lora.items()}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    shapes = [f"{n} {have[n]} (the model's is {want[n]})" for n in sorted(want.keys() & have.keys())
              if have[n] != want[n]]
    parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
             f"shape of {shapes[0]}" if shapes else ""]
    return ", ".join(p for p in parts if p)


def nearest_existing(path):
    """`path`, or its closest ancestor that exists: where a folder not yet created will live."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def strict_json(record):
    """One metrics.jsonl line: standard JSON, a NaN or inf written as null (JSON has no such numbers)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()},
                      allow_nan=False) + "\n"


class RunFolder:
    """The run folder of one training run. Every rank builds one and reads checkpoints through it; only rank 0
    writes (and takes the lock)."""

    def __init__(self, cfg, rank=0, world=1):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.root = os.path.join(cfg.out_dir, "checkpoints")
        self.lock_path = os.path.join(cfg.out_dir, ".lock")
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.last, self.saved_step = None, 0  # the newest checkpoint written or resumed from, and its step
        self.data_hash, self.eval_hash, self._candidates, self._damaged = None, None, iter(()), []
        self._lock_fd, self._metrics = None, None
        self.trackers = tracking.Trackers([])  # --report-to: TensorBoard, W&B, trackio (rank 0, once open)
        self.say = print if rank == 0 else (lambda *a, **k: None)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(failed=exc_type is not None)

    # ------------------------------------------------------------------------- before the long work

    def check(self):
        """Refuse a folder that another run holds, one that holds a run without --resume/--overwrite, and one
        that cannot be written. Writes nothing."""
        has_run = os.path.isdir(self.cfg.out_dir) and any(
            os.path.exists(os.path.join(self.cfg.out_dir, f)) for f in ("metrics.jsonl", "checkpoints", "train_config.json"))
        if has_run and not (self.cfg.overwrite or self.cfg.resume):
            raise UserError(f"{self.cfg.out_dir!r} already holds a run. Pass --resume auto to continue it, --overwrite "
                            "to replace it, or choose another --out-dir")
        for name in (".lock", "train_config.json", "metrics.jsonl"):  # what open() writes or appends to
            try:
                check_writable_file(os.path.join(self.cfg.out_dir, name))
            except UnsafePath as e:
                raise UserError(str(e)) from None
        in_use = self._in_use()
        if in_use:
            raise in_use
        if not self.cfg.overwrite:  # the adapter written at the end replaces an earlier one, nothing else
            try:
                check_replaceable(os.path.join(self.cfg.out_dir, "adapter"), ADAPTER_CONFIG)
            except ValueError as e:
                raise UserError(f"{e} (the run writes its adapter there at the end)") from None
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

    def _in_use(self):
        """The error for a folder whose lock another process holds (rank 0 asks: it takes the lock), or None."""
        if self.rank != 0 or not os.path.exists(self.lock_path):
            return None
        fd = open_regular(self.lock_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None  # free (a holder that died released it); closing the file releases it again
        except BlockingIOError:
            return self._in_use_error(fd)
        finally:
            os.close(fd)

    def _in_use_error(self, fd):
        pid, _, host = os.pread(fd, 200, 0).decode(errors="replace").strip().partition(" ")
        holder = f"PID {pid} on {host}" if pid else "a process that has not written its PID yet"
        return UserError(f"--out-dir {self.cfg.out_dir!r} is in use by another run ({holder} holds "
                         f"{self.lock_path}); wait for it to finish or stop it, or choose another --out-dir")

    # ------------------------------------------------------------------------- finding a checkpoint

    def checkpoints(self):
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
        paths = self.checkpoints()[::-1] if auto else [self.cfg.resume]
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

    def warn(self, message):
        if self.rank == 0:
            print(f"warning: {message}", file=sys.stderr)

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
        old = ck["config"]
        for key in IDENTITY:
            new = getattr(self.cfg, key)
            if not (same_model(old[key], new) if key == "model" else old[key] == new):
                raise UserError(f"--resume {ck['path']}: the checkpoint was trained with {key}={old[key]!r}, this run "
                                f"has {new!r}. Resume with the same model and LoRA settings, or start a new --out-dir")
        if ck["world_size"] != self.world:
            raise UserError(f"--resume {ck['path']}: the checkpoint was written by {ck['world_size']} process(es), this "
                            f"run has {self.world}. Resume with the same number (torchrun --nproc_per_node="
                            f"{ck['world_size']}): each process continues its own share of the data")
        changed = [f"{k} {old[k]!r} -> {getattr(self.cfg, k)!r}" for k in TRAJECTORY if old[k] != getattr(self.cfg, k)]
        if ck["data_hash"] != self.data_hash:
            changed.append("the tokenized training data (--data, --eval-fraction, the tokenizer or --max-len)")
        if changed and not self.cfg.resume_anyway:
            raise UserError(f"--resume {ck['path']}: this run differs from the checkpoint's in {'; '.join(changed)}, "
                            "so it would not continue the same run. Use the checkpoint's options (its "
                            "train_config.json), or pass --resume-anyway to continue with the new ones")
        if changed:
            self.warn(f"--resume-anyway: continuing {ck['path']} with {'; '.join(changed)}")
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
        params = dict(lora_parameters(model))
        with torch.no_grad():
            for n, t in ck["lora"].items():
                params[n].copy_(t)
        optimizer.load_state_dict(ck["optimizer"])
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

    def open(self, step):
        """Take the folder (rank 0, once every check has passed; the other ranks never write): lock it, then
        clear it (--overwrite), so that a later --resume auto cannot pick up the previous run's checkpoints,
        or (--resume) cut its metrics back to `step` and set aside newer checkpoints; write train_config.json."""
        if self.rank != 0:
            return
        try:
            os.makedirs(self.cfg.out_dir, exist_ok=True)
            self._lock()
            if self.cfg.resume:
                self._trim_metrics(step)
                self._set_aside_newer(step)
            elif self.cfg.overwrite:
                for name in ("metrics.jsonl", "checkpoints", "adapter"):
                    remove_tree(os.path.join(self.cfg.out_dir, name))  # a link is removed, never followed
            with atomic_file(os.path.join(self.cfg.out_dir, "train_config.json")) as f:
                json.dump(dataclasses.asdict(self.cfg), f, indent=2)
            self._metrics = open_append(self.metrics_path)
        except UnsafePath as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise UserError(f"cannot set up the run folder {self.cfg.out_dir!r} ({e}); nothing in it was lost") from e
        self.trackers = tracking.open_trackers(self.cfg.trackers(), self.cfg.out_dir, dataclasses.asdict(self.cfg))

    def _lock(self):
        """An exclusive flock on out/.lock for as long as this process runs: the OS drops it when the process
        ends, however it ends. The file holds 'PID host' for the error another run prints."""
        fd = open_regular(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = self._in_use_error(fd)
            os.close(fd)
            raise error from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def _trim_metrics(self, step):
        """Drop the records past the checkpoint at `step`, which the resumed run writes again (its train records
        after `step`, its evals from `step` on). They are the file's tail, so it is truncated in place at the
        first of them: one system call, whatever the file's size, so a kill leaves the old file or the new one.
        A line without its newline (cut by a kill) ends the kept part too."""
        if not os.path.lexists(self.metrics_path):
            return
        keep = 0
        with os.fdopen(open_regular(self.metrics_path, os.O_RDWR), "rb+") as f:
            for line in f:
                try:
                    r = json.loads(line) if line.endswith(b"\n") else None
                except ValueError:
                    r = None
                if not (isinstance(r, dict) and isinstance(r.get("step"), int)
                        and (r["step"] < step or (r["step"] == step and "loss" in r))):
                    break
                keep += len(line)
            os.ftruncate(f.fileno(), keep)

    def _set_aside_newer(self, step):
        """Resuming from an older checkpoint: the newer ones belong to the abandoned run, and --resume auto must
        not pick them later. They move to checkpoints/abandoned-<time>/, not deleted."""
        newer = [p for p in self.checkpoints() if int(os.path.basename(p)[5:]) > step]
        if not newer:
            return
        dest = tempfile.mkdtemp(prefix=time.strftime("abandoned-%Y%m%d-%H%M%S-"), dir=self.root)
        for path in newer:
            os.rename(path, os.path.join(dest, os.path.basename(path)))
        names = ", ".join(os.path.basename(p) for p in newer)
        self.say(f"moved {len(newer)} newer checkpoint(s) ({names}) of the abandoned run to {dest}: this run "
                 f"continues from step {step}")

    def log(self, record):
        """Append one record to metrics.jsonl (rank 0), flushed, so that a crash loses at most the line being written."""
        if self._metrics is None:
            return
        try:
            self._metrics.write(strict_json(record))
            self._metrics.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.metrics_path) from e
        self.trackers.log(record, record["step"])

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
        rngs = [rng_state()] * self.world
        if self.world > 1:  # each rank's own dropout stream, so a resume continues every one of them exactly
            dist.all_gather_object(rngs, rngs[0])
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
                "lora": {n: p.detach().cpu() for n, p in lora_parameters(model)},
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),  # fp16 loss scale and good-step counter
                "data": batches.state_dict(),  # the same on every rank: they step together
                "rng": rngs,  # one per rank
            }
            assert ck.keys() == CHECKPOINT_KEYS, "CHECKPOINT_KEYS must name what a checkpoint holds"
            write_state(tmp, ck)
            save_adapter(model, os.path.join(tmp, "adapter"), base_model=self.cfg.model)
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
            for path in self.checkpoints()[:-self.cfg.keep_checkpoints]:
                if path != final:
                    shutil.rmtree(path, ignore_errors=True)

    def save_adapter(self, model, metrics=None):
        """The run's result, out/adapter/ in PEFT's format (rank 0), after the final checkpoint."""
        if self.rank != 0:
            return
        folder = os.path.join(self.cfg.out_dir, "adapter")
        bad = nonfinite(model)
        if bad:
            raise UserError(f"not writing the adapter: {bad[0]} holds NaN/inf. {self.next_steps('lower --lr')}")
        try:
            save_adapter(model, folder, base_model=self.cfg.model, dataset=self.cfg.data,
                         options=dataclasses.asdict(self.cfg), metrics=metrics)
        except WRITE_ERRORS as e:
            raise UserError(f"cannot write the adapter to {folder} ({e}). Nothing is lost: the final checkpoint "
                            f"{self.last} holds the same weights, and {self.last}/adapter is this adapter") from e
        return folder

    def close(self, failed=False):
        """Close metrics.jsonl and release the lock. After a failure, a metrics line that cannot be flushed
        (disk full) is dropped: the error that stopped the run is the one to report."""
        metrics, self._metrics = self._metrics, None
        self.trackers.close()
        self.trackers = tracking.Trackers([])
        try:
            if metrics is not None:
                metrics.close()
        except OSError:
            if not failed:
                raise
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
