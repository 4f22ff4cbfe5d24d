"""What a `klrl train` / `klrl demo` run shows: klrl's own lines; everything else to a log file.

Other programs print far more than klrl does (Ray's notices, wandb's banners, vLLM, Triton,
NUMA and FutureWarning lines, DeepSpeed warnings), which would bury klrl's own lines.
`quiet_output(log)` sends the process's file descriptors 1 and 2 to LOG, so that whatever any
library, C extension or child process writes lands there, and puts filters in place of
`sys.stdout` / `sys.stderr` that copy a line to the terminal as well when it was written by
klrl's own code (a print, or rich's progress display, called from klrl's packages); while klrl
has nothing to say (start-up) a heartbeat line keeps the terminal from going silent. `--verbose`
(`klrl train --verbose`) skips all of it. The log is the full record either way: klrl's lines
are in it too.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Top-level packages whose writes are klrl's own (rich draws klrl's progress bars and tables).
OWN_PACKAGES = frozenset({"cluster", "actors", "learner", "kl", "rewards", "rich"})
# Modules that only pass a write on: the writer is the frame above them. wandb patches the
# `write` of sys.stdout/sys.stderr to copy the console into its run (console_capture), and Ray
# replaces `print` in a driver to keep its progress bars apart (tqdm_ray's safe_print).
TRANSPARENT = ("contextlib", "functools", "io", "codecs", "wandb.sdk.lib.console_capture",
               "wandb.sdk.lib.redirect", "ray.experimental.tqdm_ray")


def _caller_is_klrl(depth: int = 2) -> bool:
    """Whether the code that called the stream's `write` is klrl's. `print` is a builtin with
    no frame of its own, so the frame above `write` is print's caller."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] in OWN_PACKAGES:
            return True
        if not name.startswith(TRANSPARENT):
            return False
        frame = frame.f_back
    return False


class _Filter:
    """A text stream writing everything to `log` and klrl's own writes to `shown` as well
    (`last_shown`: when the terminal last got a line, for the heartbeat)."""

    last_shown = time.monotonic()

    def __init__(self, log, shown):
        self._log, self._shown = log, shown

    def write(self, text: str) -> int:
        self._log.write(text)
        if _caller_is_klrl():
            self._shown.write(text)
            self._shown.flush()
            _Filter.last_shown = time.monotonic()
        return len(text)

    def flush(self) -> None:
        self._log.flush()
        self._shown.flush()

    def isatty(self) -> bool:  # rich asks: keep the live bar where the terminal is one
        return self._shown.isatty()

    def fileno(self) -> int:
        return self._log.fileno()

    def __getattr__(self, name):
        return getattr(self._shown, name)


def _shown_stream(stream, fd: int):
    """Where klrl's lines keep going: a new stream on a copy of FD when STREAM writes to it (it
    is about to point at the log), else STREAM itself (a test's capture, say)."""
    try:
        if stream.fileno() == fd:
            return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace"), True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        pass
    return stream, False


@contextmanager
def quiet_output(log_path: Path, heartbeat_s: float = 15.0):
    """For the body: fds 1 and 2 (and so every library and child process) to LOG_PATH, klrl's
    own lines to the terminal too, and after `heartbeat_s` without one a line saying the run
    is still working (start-up, with Ray, vLLM and DeepSpeed silenced, takes a minute or more
    on a small machine). Restores everything on the way out."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    shown_out, own_out = _shown_stream(sys.stdout, 1)
    shown_err, own_err = _shown_stream(sys.stderr, 2)
    log = open(log_path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    old_streams = sys.stdout, sys.stderr
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout, sys.stderr = _Filter(log, shown_out), _Filter(log, shown_err)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(stop, heartbeat_s, log_path), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join(timeout=5)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = old_streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for stream, own in ((shown_out, own_out), (shown_err, own_err), (log, True)):
            if own:
                stream.close()


def _heartbeat(stop: threading.Event, every: float, log_path: Path) -> None:
    t0 = time.monotonic()
    _Filter.last_shown = t0
    while not stop.wait(1.0):
        now = time.monotonic()
        if now - _Filter.last_shown >= every:
            _Filter.last_shown = now  # the next one `every` seconds later, shown or not
            print(f"... still working ({now - t0:.0f} s); other programs' output so far: "
                  f"{log_path}", flush=True)
