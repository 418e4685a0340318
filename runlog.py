"""The run folder's log: who holds the folder (a lock), what it may hold (--resume, --overwrite), train_config.json,
metrics.jsonl and the trackers, and the console while training (a progress bar or lines).

    with RunLog(cfg, rank) as run:   # leaving it closes metrics.jsonl and releases the lock
        run.check()                   # before any long work: writes nothing
        run.open(step, resolved_cfg)  # lock, then clear (--overwrite) or trim (--resume); train_config.json
        run.log(record)               # one strict-JSON line of metrics.jsonl, and the trackers
        run.warn(message)             # a warning line on stderr (rank 0)

A run folder (--out-dir) holds `.lock`, `train_config.json`, `metrics.jsonl` (one record per line),
`checkpoints/` (checkpoint.py) and, at the end, `adapter/`. Only rank 0 writes.
What is guaranteed, and the tests that show it: docs/reliability.md.
"""
import dataclasses
import fcntl
import json
import math
import os
import resource
import socket
import sys
import tempfile
import time

import torch
from tqdm import tqdm

import tracking
from config import UserError
from model.adapters import ADAPTER_CONFIG, check_replaceable
from model.files import UnsafePath, atomic_file, check_writable_file, open_append, open_regular, remove_tree


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



class RunLog:
    """The log of one training run in its folder. Every rank builds one; only rank 0 writes (and takes the lock)."""

    def __init__(self, cfg, rank=0):
        self.cfg, self.rank = cfg, rank
        self.lock_path = os.path.join(cfg.out_dir, ".lock")
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self._lock_fd, self._metrics = None, None
        self.trackers = tracking.Trackers([])  # --report-to: TensorBoard, W&B, trackio (rank 0, once open)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(failed=exc_type is not None)

    # ------------------------------------------------------------------------- before the long work

    def check(self):
        """Refuse a folder that another run holds, one that holds a run without --resume/--overwrite, and one
        that cannot be written. Writes nothing."""
        has_run = os.path.isdir(self.cfg.out_dir) and any(
            os.path.exists(os.path.join(self.cfg.out_dir, f))
            for f in ("metrics.jsonl", "checkpoints", "train_config.json"))
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

    def warn(self, message):
        if self.rank == 0:
            print(f"warning: {message}", file=sys.stderr)

    # ------------------------------------------------------------------------- writing

    def open(self, step, resolved):
        """Take the folder (rank 0, once every check has passed; the other ranks never write): lock it, then
        clear it (--overwrite), so that a later --resume auto cannot pick up the previous run's checkpoints,
        or (--resume) cut its metrics back to `step`; write train_config.json: `resolved`, the options with
        the values this run derived (--max-steps from --num-epochs, the checkpointing choice)."""
        if self.rank != 0:
            return
        try:
            os.makedirs(self.cfg.out_dir, exist_ok=True)
            self._lock()
            if self.cfg.resume:
                self._trim_metrics(step)
            elif self.cfg.overwrite:
                for name in ("metrics.jsonl", "checkpoints", "adapter"):
                    remove_tree(os.path.join(self.cfg.out_dir, name))  # a link is removed, never followed
            with atomic_file(os.path.join(self.cfg.out_dir, "train_config.json")) as f:
                json.dump(dataclasses.asdict(resolved), f, indent=2)
            self._metrics = open_append(self.metrics_path)
        except UnsafePath as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise UserError(f"cannot set up the run folder {self.cfg.out_dir!r} ({e}); nothing in it was lost") from e
        self.trackers = tracking.open_trackers(self.cfg.trackers(), self.cfg.out_dir, dataclasses.asdict(resolved))

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


    def log(self, record):
        """Append one record to metrics.jsonl (rank 0), flushed, so that a crash loses at most the line being
        written."""
        if self._metrics is None:
            return
        try:
            self._metrics.write(strict_json(record))
            self._metrics.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.metrics_path) from e
        self.trackers.log(record, record["step"])

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



# ----------------------------------------------------------------------------- the console while training


def peak_memory(device):
    """The record's memory field: {"peak_mem_gib": GiB of GPU memory allocated at most so far} on a GPU, else
    {"peak_rss_gib": GiB of memory this process has held at most} (its peak resident set size)."""
    if device.type == "cuda":
        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"peak_rss_gib": peak_rss_gib()}


def peak_rss_gib():
    """GiB of memory this process has held at most so far (its peak resident set size)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30




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
        self.bar = (tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout)
                    if bar else None)
        self.window_start = time.perf_counter()  # since the last line
        self.paused_at, self.paused = None, 0.0  # seconds of the window spent paused
        self.step_start, self.step_paused = self.window_start, 0.0  # the same, for the step under way
        self.steps_timed, self.time_after_first = 0, 0.0  # steps done in this process; the time of all but the first

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
        self.steps_timed, self.time_after_first = self.steps_timed + 1, self.time_after_first + (
            took if self.steps_timed else 0.0)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if step == self.first_step + 2 and step < self.max_steps:
            left = self.max_steps - step
            steps = f"{left} step{'s' if left != 1 else ''}"
            self.log(f"estimated time: about {human_duration(took * left)} for the {steps} left ({took:.3g} s per "
                     "step after the first; evals and checkpoints add to it)")

    def eta(self, step):
        """' | ETA ...' for the steps after `step`, from the mean time of this process's steps after its first
        (which carries one-time costs); '' before there is one."""
        if self.steps_timed < 2 or step >= self.max_steps:
            return ""
        return f" | ETA {human_duration(self.time_after_first / (self.steps_timed - 1) * (self.max_steps - step))}"

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


def log_step(run, progress, rec, max_steps, fp16):
    """The step's progress (a line, or the bar's postfix on a terminal) and its record in metrics.jsonl."""
    scale = f" | scale {rec['loss_scale']:g}" if fp16 else ""
    if "rewards/margins" in rec:  # a preference step (preference.py)
        scale += f" | margin {rec['rewards/margins']:.3f} | reward acc {rec['rewards/accuracies']:.0%}"
    mem = f"peak mem {rec['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in rec else f"RSS {rec['peak_rss_gib']:.2f} GiB"
    progress.show(rec, f"step {rec['step']}/{max_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad norm "
                       f"{rec['grad_norm']:.3f} | {human_rate(rec['tokens_per_s'])}{scale} | {mem}"
                       f"{progress.eta(rec['step'])}")
    run.log(rec)


