"""Attacks on the code sandbox (safety/sandbox.py) and on the synthetic-code verifier that uses it.

Each test runs the real bubblewrap sandbox; they skip only where bwrap cannot run at all here, and
CI installs it (.ci/run)."""

import json
import os
import socket
import sys
import textwrap
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from lmfoundry.reasoning import verifiers
from lmfoundry.safety import sandbox
from lmfoundry.safety.sandbox import SandboxUnavailable, run_python

pytestmark = pytest.mark.timeout(120)
PROJECT = Path(__file__).resolve().parents[2]

try:
    run_python("pass")
except SandboxUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)


def run(code: str, **kwargs):
    return run_python(textwrap.dedent(code), **kwargs)


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


# --- running commands as the worker -----------------------------------------------------------------


def test_ctypes_system_cannot_run_a_host_command(tmp_path):
    marker = tmp_path / "pwned"
    r = run(f"""
        import ctypes
        libc = ctypes.CDLL(None)
        print("system", libc.system(b"touch {marker}"))
        print("exists", __import__("os").path.exists("/bin/sh"))
    """)
    assert r.ok, r.stderr
    assert "system 0" not in r.stdout and "exists False" in r.stdout  # no shell in the sandbox at all
    assert not marker.exists()


def test_os_system_and_subprocess_stay_inside_the_sandbox(tmp_path):
    marker = tmp_path / "pwned"
    r = run(f"""
        import os, subprocess, sys
        print("os.system", os.system("touch {marker}"))
        child = subprocess.run([sys.executable, "-c", "open('{marker}', 'w').write('x')"], capture_output=True)
        print("child", child.returncode, child.stderr.decode().strip().splitlines()[-1])
    """)
    assert r.ok, r.stderr
    assert "os.system 0" not in r.stdout and "child 1" in r.stdout and "No such file" in r.stdout
    assert not marker.exists()


# --- files ------------------------------------------------------------------------------------------


def test_writing_outside_the_scratch_directory_fails_everywhere(tmp_path):
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = ["/", "/tmp", str(tmp_path), str(PROJECT), os.path.expanduser("~"), "/usr/lib", "/dev"]
    r = run(f"""
        import os
        for folder in {targets!r}:
            try:
                with open(os.path.join(folder, {name!r}), "w") as f:
                    f.write("x")
                print("WROTE", folder)
            except OSError as e:
                print("refused", folder, type(e).__name__)
    """)
    assert r.ok, r.stderr
    assert "WROTE" not in r.stdout and r.stdout.count("refused") == len(targets)
    assert not any(os.path.exists(os.path.join(folder, name)) for folder in targets)


def test_reading_project_and_host_files_finds_nothing():
    secret_line = (PROJECT / "pyproject.toml").read_text().splitlines()[0]
    r = run(f"""
        import os
        for path in ["{PROJECT}/pyproject.toml", "/etc/passwd", "/etc/hostname", "/root/.bash_history", "/work"]:
            try:
                print(open(path).read() if os.path.isfile(path) else os.listdir(path))
            except OSError as e:
                print("refused", path, type(e).__name__)
        print(sorted(os.listdir("/")))
    """)
    assert r.ok, r.stderr
    assert secret_line not in r.stdout and r.stdout.count("refused") == 5
    assert r.stdout.strip().splitlines()[-1] == "['dev', 'lib', 'lib64', 'scratch', 'usr']"


def test_worker_environment_is_invisible_through_proc_and_environ(monkeypatch):
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("LMFOUNDRY_TEST_SECRET", secret)
    r = run("""
        import os
        print(dict(os.environ))
        for path in ["/proc/1/environ", "/proc/self/environ", "/proc/1/cmdline"]:
            try:
                print(open(path, "rb").read())
            except OSError as e:
                print("refused", path, type(e).__name__)
        for pid in range(1, 64):  # bwrap's own processes share the PID namespace: try them all
            try:
                print(open(f"/proc/{pid}/environ", "rb").read())
            except OSError:
                pass
    """)
    assert r.ok, r.stderr
    assert secret not in r.stdout and "LMFOUNDRY_TEST_SECRET" not in r.stdout
    assert r.stdout.count("refused") == 3


def test_no_file_descriptor_of_the_worker_is_inherited():
    leaked_read, leaked_write = os.pipe()
    os.set_inheritable(leaked_read, True)
    try:
        r = run("""
            import os
            for fd in range(0, 1024):
                try:
                    os.fstat(fd)
                    print(fd)
                except OSError:
                    pass
        """)
    finally:
        os.close(leaked_read)
        os.close(leaked_write)
    assert r.ok and r.stdout.split() == ["0", "1", "2"], r.stdout + r.stderr


# --- processes --------------------------------------------------------------------------------------


def test_fork_bomb_hits_the_process_limit_and_the_caller_goes_on():
    r = run(
        """
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except BlockingIOError:
            print("limit after", children)
        """,
        max_processes=16,
        timeout_s=20,
    )
    assert r.ok, r.stderr
    assert r.stdout.startswith("limit after") and int(r.stdout.split()[-1]) < 16
    assert r.seconds < 15  # the sleeping children did not hold the call open


def test_daemonised_setsid_child_does_not_outlive_the_call():
    marker = f"sandbox-daemon-{uuid.uuid4().hex}"
    r = run(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
            os._exit(0)
        time.sleep(0.5)
        print("daemon started")
    """)
    assert r.ok and "daemon started" in r.stdout, r.stderr
    time.sleep(0.5)
    assert processes_with(marker) == []


def test_timeout_kills_every_process_of_the_sandbox():
    marker = f"sandbox-timeout-{uuid.uuid4().hex}"
    r = run(
        f"""
        import os, sys, time
        for _ in range(3):
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
        time.sleep(60)
        """,
        timeout_s=2,
    )
    assert r.killed == "timeout" and r.seconds < 6
    time.sleep(0.5)
    assert processes_with(marker) == []


# --- sockets ----------------------------------------------------------------------------------------


def test_unix_socket_of_the_host_is_unreachable(tmp_path):
    path = str(tmp_path / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(0.5)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"lmfoundry-{uuid.uuid4().hex}"
    abstract.bind("\0" + abstract_name)
    abstract.listen(1)
    abstract.settimeout(0.5)
    try:
        r = run(f"""
            import socket
            for address in [{path!r}, "\\0{abstract_name}"]:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                    print("CONNECTED", repr(address))
                except OSError as e:
                    print("refused", type(e).__name__)
        """)
        assert r.ok, r.stderr
        assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2
        for listener in (server, abstract):
            with pytest.raises(TimeoutError):
                listener.accept()
    finally:
        server.close()
        abstract.close()


def test_tcp_to_a_local_listener_and_other_socket_families_are_denied():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run(f"""
            import socket
            for family, kind in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_STREAM),
                                 (socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_NETLINK, socket.SOCK_RAW),
                                 (socket.AF_PACKET, socket.SOCK_RAW)]:
                try:
                    s = socket.socket(family, kind)
                    s.settimeout(1)
                    s.connect(("127.0.0.1", {port}))
                    print("CONNECTED", family)
                except OSError as e:
                    print("refused", e.errno)
        """)
        assert r.ok, r.stderr
        assert r.stdout.split() == ["refused", "1"] * 5  # EPERM from the seccomp filter, at socket()
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


# --- syscalls ---------------------------------------------------------------------------------------


def test_ptrace_mount_unshare_and_keyring_syscalls_are_denied():
    r = run("""
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {
            "ptrace": lambda: libc.ptrace(0, 0, 0, 0),  # PTRACE_TRACEME
            "mount": lambda: libc.mount(b"none", b"/scratch", b"tmpfs", 0, None),
            "unshare_user": lambda: libc.unshare(0x10000000),  # CLONE_NEWUSER
            "unshare_net": lambda: libc.unshare(0x40000000),
            "keyctl": lambda: libc.syscall(250, 0, 0, 0, 0, 0),  # keyctl(GET_KEYRING_ID)
            "bpf": lambda: libc.syscall(321, 0, 0, 0),
            "personality": lambda: libc.personality(0x0040000),  # ADDR_NO_RANDOMIZE
            "userfaultfd": lambda: libc.syscall(323, 0),
            "io_uring_setup": lambda: libc.syscall(425, 1, 0),
        }
        for name, call in calls.items():
            ctypes.set_errno(0)
            print(name, call(), errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
    """)
    assert r.ok, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 9 and all(line.endswith(" -1 EPERM") for line in lines), r.stdout


# --- resources --------------------------------------------------------------------------------------


def test_memory_blow_up_is_stopped():
    r = run("x = bytearray(4 << 30)", memory_mb=256)
    assert r.killed == "memory" and not r.ok


def test_infinite_loop_is_killed_on_cpu_time():
    r = run("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert r.killed == "cpu" and r.seconds < 10  # the CPU limit, not the wall-clock timeout, stopped it


def test_huge_file_and_full_scratch_are_refused():
    r = run(
        """
        import os
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (8 << 20))
        except OSError as e:
            print("file", e.errno)
        written = 0
        try:
            for i in range(100):
                with open(f"part{i}", "wb") as f:
                    f.write(b"x" * (1 << 20))
                written += 1
        except OSError as e:
            print("scratch", e.errno, written)
        """,
        file_mb=2,
        scratch_mb=16,
    )
    assert r.ok, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "file 27"  # EFBIG: RLIMIT_FSIZE
    assert lines[1].startswith("scratch 28") and int(lines[1].split()[-1]) <= 16  # ENOSPC: the tmpfs cap


def test_huge_output_is_cut_at_the_cap_without_buffering_it():
    tracemalloc.start()
    try:
        r = run("import sys\nfor _ in range(200):\n    sys.stdout.write('x' * (1 << 20))", max_output=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.ok and r.truncated and len(r.stdout) == 1 << 16
    assert peak < 8 << 20, f"the caller held {peak / 2**20:.1f} MiB for 200 MiB of output"


# --- fail closed ------------------------------------------------------------------------------------


def test_missing_bubblewrap_refuses_to_run_instead_of_running_weaker(monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox, "_BWRAP_PATHS", ())
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        run_python(f"open({str(marker)!r}, 'w').write('x')")
    assert not marker.exists()


def test_file_names_cannot_leave_the_scratch_directory():
    for name in ["../x", "/etc/x", "a/../../x", "", "main.py"]:
        with pytest.raises(ValueError, match="sandbox file"):
            run_python("pass", files={name: "x"})


# --- the verifier cannot be forged ------------------------------------------------------------------

TESTS = "assert double(2) == 4\nassert double(-1) == -2\nassert double(0) == 0"


@pytest.mark.parametrize(
    "attack, answer",
    [
        ("prints pass", "def double(x):\n    return x\nprint('ALL TESTS PASSED')\nprint('PASS')"),
        ("exits 0 early", "import os\nprint('ALL TESTS PASSED', flush=True)\nos._exit(0)"),
        ("raises SystemExit", "raise SystemExit(0)"),
        ("monkeypatches eval", "import builtins\nbuiltins.eval = lambda *a, **k: 4\ndef double(x):\n    return 0"),
        ("monkeypatches json", "import json\njson.dumps = lambda *a, **k: '4'\ndef double(x):\n    return 0"),
        (
            "writes a fake result file",
            "open('result.json', 'w').write('{\"passed\": true}')\ndef double(x):\n    return 1",
        ),
        (
            "forges the result line with the nonce",
            "import sys, json, os\nnonce = sys._getframe(1).f_globals['request']['nonce']\n"
            "print(nonce + ' ' + json.dumps([{'value': True}] * 3), flush=True)\nos._exit(0)",
        ),
        (
            "adds a second result line at exit",
            "import atexit, sys, json\nnonce = sys._getframe(1).f_globals['request']['nonce']\n"
            "atexit.register(lambda: print(nonce + ' ' + json.dumps([{'value': 4}, {'value': -2}, {'value': 0}])))\n"
            "def double(x):\n    return x",
        ),
        ("returns True for equality", "def double(x):\n    return True"),
        (
            "returns an object equal to anything",
            "class Any:\n    __eq__ = lambda s, o: True\ndef double(x):\n    return Any()",
        ),
    ],
)
def test_verifier_rejects_a_forged_pass(attack, answer):
    reason = verifiers.verify_code({"answer": answer, "tests": TESTS}, timeout_s=10)
    assert reason is not None and "tests failed" in reason, (attack, reason)
    assert verifiers.verify_code({"answer": "def double(x):\n    return 2 * x", "tests": TESTS}, 10) is None


def test_verifier_refuses_tests_it_cannot_judge_outside_the_sandbox():
    with pytest.raises(ValueError, match="only assert statements"):
        verifiers.code_checks("import os\nassert f(1) == 1")
    with pytest.raises(ValueError, match="must be a literal"):
        verifiers.code_checks("assert f(1) == g(2)")
    assert json.dumps(verifiers.code_checks("assert not f('a')\nassert f(2) == [1, 2]")) == json.dumps(
        [["f('a')", "false", None], ["f(2)", "equal", [1, 2]]]
    )


def test_sandbox_runs_the_system_or_own_interpreter_only():
    r = run("import sys\nprint(sys.version_info[:2], sys.flags.isolated, sys.flags.no_site)")
    assert r.ok and r.stdout.strip() == f"{tuple(sys.version_info[:2])} 1 1"


def test_program_cannot_fake_a_sandbox_failure_to_abort_its_caller():
    # bwrap's own setup errors read "bwrap: ..." with status 1; a program printing the same is only a failed program
    r = run("import sys\nsys.stderr.write('bwrap: Creating new namespace failed\\n')\nsys.exit(1)")
    assert not r.ok and r.returncode == 1 and r.stderr.startswith("bwrap: ")
