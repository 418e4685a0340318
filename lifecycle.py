"""How a run ends other than by finishing: signals (Ctrl-C, SIGTERM, a hangup), a write that fails, a step that
runs out of memory. Each ends with a checkpoint where one can be saved and one line that says how to go on.

    with StopSignals(say=rank == 0) as signals: ...      # signals.due(step): stop after this step
    except (OSError, torch.OutOfMemoryError) as e: raise save_after_failure(e, ...) from e

Exit statuses: 0 complete, 2 bad input or a failure (one `error:` line), 128 + the signal's number when a
signal stopped the run after its checkpoint (130 for Ctrl-C, 143 for SIGTERM, 129 for a hangup).
"""
import errno
import os
import signal
import stat
import sys

import torch

from checkpoint import Checkpoints
from config import UserError
from memory import memory_fixes
from statefiles import rewind


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
        self.streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = HangupSafe(sys.stdout), HangupSafe(sys.stderr)
        return self

    def __exit__(self, *_):
        sys.stdout, sys.stderr = self.streams
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


class HangupSafe:
    """A console stream (sys.stdout, sys.stderr while a run trains) whose writes survive the terminal going away.
    A hung-up terminal fails every write with EIO before the SIGHUP handler has run, so a print in flight would
    end the run with an error instead of its checkpoint: here that write points the console at /dev/null and is
    dropped, and the signal stops the run after its step, as it does when it comes first."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_console()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_console()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


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


def save_after_failure(e, cfg, ckpts, step, model, optimizer, scaler, batches, start, checkpointing):
    """The one-line error for a write that failed (disk full) or a step that ran out of GPU memory, after a
    checkpoint of the last complete step where one can be saved: by a single process (with several, the
    others are not in the save), with finite weights. An out-of-memory step is first rewound to the data
    position and random state it started from, so that the checkpoint resumes exactly. `checkpointing`: whether
    the run used gradient checkpointing (the fixes offered depend on it)."""
    if isinstance(e, torch.OutOfMemoryError):
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if start is not None:
            rewind(batches, start)
        what = f"out of GPU memory in step {step + 1} (micro-batches of {cfg.batch_size} x {cfg.max_len} tokens)"
        fix = memory_fixes(cfg, checkpointing) + " (a resume with other sizes needs --resume-anyway)"
    else:
        what, fix = f"cannot write {e.filename or 'to disk'} ({e.strerror or e})", f"free disk space in {cfg.out_dir}"
    if step > ckpts.saved_step and ckpts.world == 1:
        try:
            ckpts.save(step, model, optimizer, scaler, batches)
        except UserError:
            what += "; no checkpoint of it could be written either"
    return UserError(f"{what}. {ckpts.next_steps(fix)}")


def interrupted(cfg):
    """The line for a run stopped before its loop could save (a signal during the setup, or a third one)."""
    saved = Checkpoints(cfg).list() if cfg is not None else []
    where = (f"the newest checkpoint is {saved[-1]}: continue from it with --resume auto" if saved else
             "no checkpoint was saved")
    return f"interrupted: {where}"


def command_line(main, parse):
    """main(parse()) as a command's exit status: bad input is one `error: ...` line and status 2, no traceback
    (ImportError: an optional package). A run that a signal stopped exits with 128 + its number (130 for Ctrl-C),
    also when a third one aborted its save."""
    cfg = None
    try:
        cfg = parse()
        return main(cfg)
    except (UserError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(interrupted(cfg), file=sys.stderr)
        return 128 + (e.args[0] if e.args else signal.SIGINT)
