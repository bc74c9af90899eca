"""Running untrusted Python: a separate process with CPU, memory, file-size, process and wall-clock
limits, a scratch directory as its whole world, and no network.

- Limits: `setrlimit` in the child before it starts Python (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_NPROC where it means something), a wall-clock timeout after which the process group is
  killed, output capped.
- Files: the working directory is a fresh temporary directory, deleted afterwards; Python runs
  isolated (`-I`: no user site, no PYTHON* variables, the script's directory not on the path),
  with an empty environment, and an audit hook refuses `open` for writing, and `os` calls that
  create, remove or rename files, outside the scratch directory.
- Network: a network namespace of its own (`unshare -n`, no interface but a downed loopback)
  where the kernel allows it; otherwise the audit hook refuses every socket connect, bind and
  DNS lookup. `result.network_isolation` says which one held.

The audit hook is Python-level: it stops Python code, not native code a C extension runs. The
resource limits and the namespace are the kernel's.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

_PRELUDE = textwrap.dedent("""
    import os, sys
    _SCRATCH = os.path.realpath(os.getcwd())
    _WRITE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
                     "os.chmod", "os.chown", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
    _NET_EVENTS = {"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto"}
    def _inside(path):
        try:
            real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
        except (TypeError, ValueError):
            return False
        return real == _SCRATCH or real.startswith(_SCRATCH + os.sep)
    def _hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and not _inside(args[0]):
                raise PermissionError(f"sandbox: writing outside the scratch directory: {args[0]}")
        elif event in _WRITE_EVENTS and args and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError(f"sandbox: {event} outside the scratch directory")
        elif event in _NET_EVENTS and {block_network}:
            raise PermissionError(f"sandbox: no network ({event})")
        elif event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty"):
            raise PermissionError(f"sandbox: no new processes ({event})")
    sys.addaudithook(_hook)
    del _hook
""")


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    killed: str | None  # "timeout", "cpu", "memory" or None
    network_isolation: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None


def _namespace_available() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_NAMESPACE = None


def run_python(
    code: str,
    timeout_s: float = 10.0,
    cpu_s: int = 10,
    memory_mb: int = 512,
    max_output: int = 1 << 16,
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run `code` as a script in the sandbox; `files` are written into the scratch directory first."""
    global _NAMESPACE
    if _NAMESPACE is None:
        _NAMESPACE = _namespace_available()
    isolation = "namespace" if _NAMESPACE else "audit-hook"
    scratch = tempfile.mkdtemp(prefix="lmfoundry-sandbox-")
    try:
        for name, text in (files or {}).items():
            path = os.path.join(scratch, name)
            if not os.path.realpath(path).startswith(os.path.realpath(scratch) + os.sep):
                raise ValueError(f"sandbox file {name!r} would lie outside the scratch directory")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(_PRELUDE.replace("{block_network}", "True") + "\n" + code)

        def limits():
            os.setsid()
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        command = [sys.executable, "-I", "-X", "utf8", "main.py"]
        if _NAMESPACE:
            command = [shutil.which("unshare"), "-n", *command]
        started = time.perf_counter()
        proc = subprocess.Popen(
            command,
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limits,
        )
        killed = None
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            killed = "timeout"
        seconds = time.perf_counter() - started
        if killed is None and proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # RLIMIT_CPU, soft or hard
            killed = "cpu"
        stderr = err[:max_output].decode("utf-8", "replace")
        if killed is None and "MemoryError" in stderr:
            killed = "memory"
        return SandboxResult(
            proc.returncode, out[:max_output].decode("utf-8", "replace"), stderr, round(seconds, 3), killed, isolation
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
