"""Run one measured process of ``pagedkv bench models`` under a timeout and an RSS guard.

``RLIMIT_AS`` is wrong for a process that memory-maps its model (the mapping counts whole),
so the parent polls the child's resident set (``VmRSS`` of ``/proc/<pid>/status``) and kills
its process group above a limit, recording "killed at N GB". The child is reaped with
``os.wait4``, whose ``ru_maxrss`` is its peak RSS (the same measure for pagedkv and for
llama.cpp's tools).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

GB = 1e9


def proc_rss_bytes(pid: int) -> Optional[int]:
    """Resident set size of process ``pid`` in bytes (``VmRSS``), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def fadvise_dontneed(path: str | Path) -> dict[str, Any]:
    """Ask the kernel to drop ``path``'s pages from the page cache (``posix_fadvise
    DONTNEED`` after an ``fsync``; clean pages only). Returns what was done and the bytes
    still resident after it (``fincore``; None where it is unavailable)."""
    out: dict[str, Any] = {"method": "posix_fadvise(POSIX_FADV_DONTNEED)", "ok": False}
    try:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            out["ok"] = True
        finally:
            os.close(fd)
    except (OSError, AttributeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["resident_bytes_after"] = resident_bytes(path)
    return out


def resident_bytes(path: str | Path) -> Optional[int]:
    """Bytes of ``path`` in the page cache (``fincore --bytes``), None if that fails."""
    try:
        r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.split() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def run_guarded(cmd: Sequence[str], *, timeout_s: float, rss_limit_bytes: float, env: Optional[dict[str, str]] = None,
                stdout_path: Optional[Path] = None, poll_s: float = 0.2,
                ready: Optional[Callable[[], bool]] = None,
                rss_of: Callable[[int], Optional[int]] = proc_rss_bytes) -> dict[str, Any]:
    """Run ``cmd`` (its own session; stdout to ``stdout_path`` or discarded, stderr's tail
    kept) until it exits, ``timeout_s`` passes, its RSS passes ``rss_limit_bytes`` or, with
    ``ready``, ``ready()`` turns true (then it is terminated: a server measured to ready).
    Returns ``status`` (``ok`` | ``failed`` | ``killed_rss`` | ``timeout`` | ``ready``),
    ``returncode``, ``wall_s``, ``ready_s`` (with ``ready``), ``peak_rss_polled`` and
    ``ru_maxrss`` (bytes), ``killed_at_bytes`` and ``reason``."""
    import tempfile

    err = tempfile.TemporaryFile()
    out_f = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=env, stdout=out_f, stderr=err, start_new_session=True)
    status, peak, killed_at, ready_s = None, 0, None, None
    ru_maxrss, rc = None, None
    try:
        while True:
            pid, wstatus, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                rc = os.waitstatus_to_exitcode(wstatus)
                proc.returncode = rc
                ru_maxrss = ru.ru_maxrss * 1024
                break
            rss = rss_of(proc.pid)
            if rss is not None:
                peak = max(peak, rss)
            elapsed = time.perf_counter() - t0
            if status is None and rss is not None and rss > rss_limit_bytes:
                status, killed_at = "killed_rss", rss
                _kill(proc, signal.SIGKILL)
            elif status is None and elapsed > timeout_s:
                status = "timeout"
                _kill(proc, signal.SIGKILL)
            elif status is None and ready is not None and ready():
                status, ready_s = "ready", elapsed
                _kill(proc, signal.SIGTERM)
            time.sleep(poll_s)
    finally:
        if proc.returncode is None:  # interrupted (an exception in this loop): never leave the child running
            _kill(proc, signal.SIGKILL)
            proc.wait()
        if stdout_path:
            out_f.close()  # type: ignore[union-attr]
    wall = time.perf_counter() - t0
    err.seek(0)
    tail = err.read().decode(errors="replace").strip().splitlines()[-8:]
    err.close()
    if status is None:
        status = "ok" if rc == 0 else "failed"
    reason = None
    if status == "killed_rss":
        reason = f"killed at {killed_at / GB:.1f} GB (RSS limit {rss_limit_bytes / GB:.0f} GB)"
    elif status == "timeout":
        reason = f"no result after {timeout_s:.0f} s"
    elif status == "failed":
        reason = f"exit {rc}: " + " | ".join(tail)[-600:]
    return {"status": status, "returncode": rc, "wall_s": wall, "ready_s": ready_s, "peak_rss_polled": peak,
            "ru_maxrss": ru_maxrss, "killed_at_bytes": killed_at, "reason": reason}


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
