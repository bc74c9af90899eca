"""Running untrusted Python (the agents' `python` tool, the synthetic-code verifier) inside a
bubblewrap sandbox: kernel namespaces, a seccomp filter and resource limits, the way Flatpak,
nsjail and the code-interpreter sandboxes built on them do it, rather than in-process checks.

Why this mechanism: an in-process guard (audit hooks, restricted builtins, codejail-style
AppArmor-less tricks) is bypassed by any code that reaches native calls (`ctypes`, a C
extension). Isolation must be the kernel's. gVisor (a user-space kernel) is stronger but needs
its own runtime; Firecracker needs KVM. bubblewrap is one small unprivileged binary packaged by
every distribution, uses the same namespace and seccomp primitives as nsjail and Docker, and
works both on a host and inside an unprivileged container where user namespaces are allowed.

What each call gets:
- Namespaces (`--unshare-all`): its own user, PID, mount, network, IPC, UTS and cgroup
  namespaces. No network interface but a downed loopback; abstract Unix sockets are per network
  namespace, and no host socket file is mounted, so no local service is reachable.
- Files: a root holding only the Python install (read-only) and the shared libraries in
  /usr/lib (read-only), a minimal /dev, no /proc (so nothing to read about any process), and a
  private size-capped tmpfs at /scratch as cwd and HOME. The project, /home, /root, /work and
  /tmp are not there. Files given by the caller are copied in; nothing comes back out.
- Identity: uid/gid 65534 inside. When the worker runs as root, bwrap itself is started as
  65534 too, because the kernel exempts root from RLIMIT_NPROC (and it keeps the sandbox off
  root's uid should anything escape).
- Environment: cleared (`--clearenv`, and bwrap itself gets an empty one so no secret is in
  any process's memory there); PATH, HOME and LANG only. No file descriptor but 0, 1 and 2.
- seccomp (libseccomp via pyseccomp): EPERM for ptrace, mount, namespaces (unshare, setns, and
  clone with namespace flags), keyring, bpf, perf_event_open, module loading, kexec, reboot,
  swap, process_vm_readv/writev, personality, userfaultfd, io_uring, and sockets of any family
  but AF_UNIX. Syscalls of another ABI (32-bit, x32) kill the process.
- Limits: RLIMIT_AS (memory, per process: a run's processes together hold at most
  max_processes x memory_mb, a cgroup's memory.max would make it one budget), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC (set
  inside, after the user namespace exists, so it counts this sandbox's processes only), no core
  files; a wall-clock timeout; stdout and stderr read as they come and kept up to a byte cap.
- Lifetime: `--die-with-parent`, `--new-session`, and a PID namespace whose init is bwrap's
  reaper: when the program exits or the timeout kills bwrap, every process it left is killed by
  the kernel.

Fails closed: where bwrap or libseccomp is missing, or the kernel refuses user namespaces,
`run_python` raises SandboxUnavailable saying what to install or enable; it never runs the code
with less isolation.

What it does not defend against: kernel bugs reachable through the syscalls still allowed (a
user-space kernel such as gVisor is the answer to that), CPU and memory-bandwidth side
channels, and a scratch tmpfs that counts against host memory up to its size cap. Inside, the
code may do anything it likes to its own process; callers must treat everything it prints as
untrusted data (see align/synth.py, whose verifier decides pass/fail outside the sandbox).
"""

from __future__ import annotations

import errno
import os
import resource
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass

SANDBOX_UID = 65534  # "nobody"
SCRATCH = "/scratch"
_READ_CHUNK = 1 << 16

# Runs first inside the sandbox: RLIMIT_NPROC is set here, after bwrap made the user namespace, so
# that it counts the processes of this sandbox only (set outside, it would count every process of
# the worker's uid). A NUL byte on stderr then says the sandbox is up, before any untrusted code
# could write there. Then the caller's program runs as __main__ with its own file name.
_STARTED = b"\0"
_LAUNCHER = (
    "import os,resource as r,sys;os.write(2,b'\\0');n={nproc};r.setrlimit(r.RLIMIT_NPROC,(n,n));del r,n;sys.argv=['main.py'];"
    "exec(compile(open('main.py',encoding='utf-8').read(),'main.py','exec'),{{'__name__':'__main__'}})"
)


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is missing here; nothing was run."""


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    killed: str | None  # "timeout", "cpu", "memory" or None
    network_isolation: str = "bwrap"  # kept for callers that report it: always the bwrap sandbox now
    truncated: bool = False  # stdout or stderr went over max_output and was cut

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None


# --- seccomp ----------------------------------------------------------------------------------------

_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "memfd_create", "memfd_secret",  # anonymous files: their pages escape RLIMIT_AS
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    "personality",
)  # fmt: skip
_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)
_SECCOMP_BPF: bytes | None = None


def _seccomp_program() -> bytes:
    """The compiled BPF filter, built once: allow by default, EPERM for what a program never needs."""
    global _SECCOMP_BPF
    if _SECCOMP_BPF is not None:
        return _SECCOMP_BPF
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as e:  # OSError: the package is there, libseccomp.so.2 is not
        raise SandboxUnavailable(
            f"the sandbox needs libseccomp and pyseccomp ({e}): apt-get install -y libseccomp2; pip install pyseccomp"
        ) from None
    deny = seccomp.ERRNO(errno.EPERM)
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in _DENIED_SYSCALLS:
        f.add_rule(deny, name)
    for flag in _NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, where seccomp cannot look: ENOSYS makes libc fall back to clone.
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(deny, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    f.add_rule(deny, "socketpair", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as out:
            f.export_bpf(out)
        with os.fdopen(read, "rb") as source:
            read = -1
            _SECCOMP_BPF = source.read()
    finally:
        if read >= 0:
            os.close(read)
    return _SECCOMP_BPF


# --- bwrap ------------------------------------------------------------------------------------------


_BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap")  # where packages put it, should PATH not hold it


def _bwrap() -> str:
    path = shutil.which("bwrap") or next((p for p in _BWRAP_PATHS if os.access(p, os.X_OK)), None)
    if path is None:
        raise SandboxUnavailable(
            "the sandbox needs bubblewrap, which is not installed: apt-get install -y bubblewrap "
            "(or dnf install bubblewrap)"
        )
    return path


def _open_to_all(path: str) -> bool:
    """Whether any user can reach and read `path`: the sandbox user must, when bwrap runs as it."""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    parent = os.path.dirname(path)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


def _interpreter(as_nobody: bool) -> str:
    """The real Python binary the sandbox runs: the worker's own (not a venv's link to it), or, when
    bwrap runs as the sandbox user and that one lies where it cannot reach (pyenv under /root), the
    system's python3. Only the standard library is there, either way."""
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    candidates = [own] if not as_nobody else [own, "/usr/bin/python3"]
    for executable in candidates:
        if os.path.exists(executable) and (not as_nobody or _open_to_all(executable)):
            return os.path.realpath(executable)
    raise SandboxUnavailable(
        f"the sandbox runs Python as uid {SANDBOX_UID}, which cannot reach {own} (a parent directory is "
        "not searchable by all users) and there is no /usr/bin/python3: apt-get install -y python3-minimal"
    )


def _interpreter_binds(executable: str) -> list[str]:
    """The binary and its install's lib/ (stdlib, libpython), read-only, at the same paths."""
    args = ["--ro-bind", executable, executable]
    lib = os.path.join(os.path.dirname(os.path.dirname(executable)), "lib")
    if os.path.isdir(lib) and not lib.startswith("/usr/lib"):
        args += ["--ro-bind", lib, lib]
    return args


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # close-on-exec off: bwrap reads it, then closes it
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _library_binds() -> list[str]:
    """Read-only binds of the shared libraries the interpreter and its extension modules load."""
    args = []
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32"):
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, path]
    for link in ("/lib", "/lib64"):
        if os.path.islink(link):  # merged /usr (Debian, Fedora, Arch)
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


@dataclass
class _Launch:
    command: list[str]
    fds: list[int]
    drop_to_nobody: bool


def _launch(code: str, files: dict[str, str], cpu_s: int, nproc: int, scratch_mb: int) -> _Launch:
    as_nobody = os.geteuid() == 0
    executable = _interpreter(as_nobody)
    fds = []

    def fd_of(name: str, data: bytes) -> str:
        fds.append(_memfd(name, data))
        return str(fds[-1])

    command = [
        _bwrap(),
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_UID),
        *_interpreter_binds(executable),
        *_library_binds(),
        "--dev", "/dev",
        "--perms", "0700", "--size", str(scratch_mb << 20), "--tmpfs", SCRATCH,
        "--chdir", SCRATCH,
        "--clearenv",
        "--setenv", "PATH", os.path.dirname(executable),
        "--setenv", "HOME", SCRATCH,
        "--setenv", "LANG", "C.UTF-8",
        "--seccomp", fd_of("seccomp", _seccomp_program()),
        "--perms", "0600", "--file", fd_of("main", code.encode("utf-8")), f"{SCRATCH}/main.py",
    ]  # fmt: skip
    for name, text in files.items():
        command += ["--perms", "0600", "--file", fd_of("file", text.encode("utf-8")), f"{SCRATCH}/{name}"]
    # bwrap builds / and /dev on tmpfs mounts of their own: read-only, so only the capped scratch takes writes.
    command += ["--remount-ro", "/dev", "--remount-ro", "/"]
    command += ["--", executable, "-I", "-S", "-X", "utf8", "-c", _LAUNCHER.format(nproc=nproc)]
    return _Launch(command, fds, drop_to_nobody=as_nobody)


def _checked_file_name(name: str) -> str:
    if not name or name.startswith("/") or os.path.normpath(name) != name or name.split("/")[0] == "..":
        raise ValueError(f"sandbox file {name!r} would lie outside the scratch directory; use a plain relative name")
    if "/" in name or name == "main.py":
        raise ValueError(f"sandbox file {name!r}: give a plain file name (no directories), other than main.py")
    return name


def _preexec(cpu_s: int, memory_mb: int, file_mb: int, drop_to_nobody: bool):
    def limits():
        # Inherited by bwrap and so by the program; bwrap itself needs little memory.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if drop_to_nobody:
            os.setgroups([])
            os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)

    return limits


class _CappedOutput:
    """Keeps the first `cap` bytes of a stream and counts (then drops) the rest."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.seen = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]

    def text(self) -> str:
        return self.kept.decode("utf-8", "replace")

    def started(self) -> bool:
        """Whether the launcher's mark leads the stream (and drop it)."""
        if not self.kept.startswith(_STARTED):
            return False
        del self.kept[: len(_STARTED)]
        self.seen -= len(_STARTED)
        return True


def _collect(proc: subprocess.Popen, timeout_s: float, max_output: int) -> tuple[_CappedOutput, _CappedOutput, bool]:
    """Read stdout and stderr as they come until both close or the deadline; True if it passed."""
    out, err = _CappedOutput(max_output), _CappedOutput(max_output)
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return out, err, True
            for key, _ in selector.select(min(left, 0.5)):
                chunk = os.read(key.fd, _READ_CHUNK)
                if chunk:
                    key.data.add(chunk)
                else:
                    selector.unregister(key.fileobj)
    return out, err, False


def _kill_tree(proc: subprocess.Popen) -> None:
    """bwrap leads its own process group; killing it takes its PID namespace, and so every process
    the program started, with it (--die-with-parent on bwrap's init, the kernel on the namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_python(
    code: str,
    timeout_s: float = 10.0,
    cpu_s: int = 10,
    memory_mb: int = 512,
    max_output: int = 1 << 16,
    files: dict[str, str] | None = None,
    max_processes: int = 32,
    file_mb: int = 16,
    scratch_mb: int = 64,
    stdin: bytes = b"",
) -> SandboxResult:
    """Run `code` as a script in the sandbox; `files` (plain name -> text) are copied into its
    scratch directory first, `stdin` is its standard input. Raises SandboxUnavailable, and runs
    nothing, where the sandbox cannot be set up."""
    files = {_checked_file_name(name): text for name, text in (files or {}).items()}
    launch = _launch(code, files, cpu_s, max_processes, scratch_mb)
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(
            launch.command,
            env={},  # bwrap's own environment is readable by its children: keep it empty
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=launch.fds,
            start_new_session=True,
            preexec_fn=_preexec(cpu_s, memory_mb, file_mb, launch.drop_to_nobody),
        )
    finally:
        for fd in launch.fds:
            os.close(fd)
    try:
        _feed(proc, stdin)
        out, err, timed_out = _collect(proc, timeout_s, max_output)
    finally:
        _kill_tree(proc)  # the program is done or out of time: nothing of it may outlive the call
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    seconds = time.perf_counter() - started
    if not err.started() and not timed_out:
        _raise_sandbox_failed(err.text())
    return SandboxResult(
        proc.returncode,
        out.text(),
        err.text(),
        round(seconds, 3),
        _killed_by(proc.returncode, err.text(), timed_out),
        truncated=out.seen > max_output or err.seen > max_output,
    )


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        if data:
            proc.stdin.write(data)  # small inputs only: the pipe buffer (64 KiB) must hold it
        proc.stdin.close()
    except BrokenPipeError:
        pass


def _killed_by(returncode: int | None, stderr: str, timed_out: bool) -> str | None:
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    if "MemoryError" in stderr:
        return "memory"
    return None


def _raise_sandbox_failed(stderr: str) -> None:
    """The launcher never started: bwrap (or the interpreter) failed before any untrusted code ran.
    Judged by the launcher's mark, not by what stderr says, which the program itself could forge."""
    first = (stderr.strip().splitlines() or ["no message"])[0]
    raise SandboxUnavailable(
        f"the sandbox could not be set up ({first}); bubblewrap needs unprivileged user namespaces: "
        "sysctl kernel.unprivileged_userns_clone=1 (Debian), user.max_user_namespaces > 0, and on "
        "Ubuntu 24.04+ an AppArmor profile allowing userns for bwrap"
    )
