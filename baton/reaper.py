"""Nothing left behind when ``baton serve`` dies, by any signal.

A launcher that exits normally stops what it started (``Stack.stop``). One killed with SIGKILL runs no code,
so its private redis-server and the processes of the local Ray it started would live on, orphaned, with their
temporary folders. ``start`` runs a small watcher beside it (``python -m baton.reaper PID``, in a session of
its own so that a terminal's signals to the launcher's group do not reach it). The watcher notes every
process below the launcher twice a second and reads its stdin, a pipe whose only writer is the launcher. When
the pipe closes (the kernel closes it whichever way the launcher ends) or the launcher is gone, it ends the
processes it noted that still run (SIGTERM, SIGKILL after a grace), then removes the folders the launcher
named with ``own_dir``. After a clean stop it finds nothing running and only removes the folders.

Only a process that is the stack's launcher starts one (``baton serve``): a watcher of a process that also
runs other things (a test run) would end those too.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import threading

_watcher: subprocess.Popen | None = None
_lock = threading.Lock()

POLL_S = 0.5
GRACE_S = 3.0


def start() -> None:
    """Start this process's watcher (once)."""
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = subprocess.Popen([sys.executable, "-m", "baton.reaper", str(os.getpid())],
                                        stdin=subprocess.PIPE, start_new_session=True)


def own_dir(path: str) -> None:
    """A folder to remove once this process is gone (nothing happens without a watcher)."""
    with _lock:
        if _watcher is not None and _watcher.stdin is not None:
            _watcher.stdin.write(f"dir {path}\n".encode())
            _watcher.stdin.flush()


def _end(processes: list, dirs: list[str]) -> None:
    import psutil

    alive = [p for p in processes if p.is_running()]
    for p in list(alive):  # and what they started since the last look
        with contextlib.suppress(psutil.Error):
            alive += p.children(recursive=True)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=GRACE_S)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def watch(pid: int) -> None:
    import psutil

    me = os.getpid()
    try:
        launcher = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    seen: dict[int, psutil.Process] = {}
    dirs: list[str] = []
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        try:
            for p in launcher.children(recursive=True):
                if p.pid != me:
                    seen.setdefault(p.pid, p)  # psutil.Process remembers its start time: no reused PIDs
        except psutil.NoSuchProcess:
            break
        if not launcher.is_running():
            break
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                verb, _, arg = line.decode(errors="replace").partition(" ")
                if verb == "dir" and arg:
                    dirs.append(arg)
    _end(list(seen.values()), dirs)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
