"""The code sandbox's cost and its limits (safety/sandbox.py).

    python benchmarks/sandbox.py            # 30 calls each
    python benchmarks/sandbox.py --quick    # 8 calls each

Per-call overhead: the median wall time of N runs of a trivial program, in the bubblewrap sandbox
and as a plain `python -c` subprocess, side by side in the same run. Then each limit (memory, CPU,
processes, file size, output) is hit once and whether it held is recorded. Writes
benchmarks/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lmfoundry.safety.sandbox import run_python


def median_seconds(call, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def limits() -> list[dict]:
    memory = run_python("x = bytearray(2 << 30)", memory_mb=256)
    cpu = run_python("while True:\n    pass", cpu_s=1, timeout_s=30)
    fork = run_python(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(5)\n"
        "            os._exit(0)\n        n += 1\nexcept BlockingIOError:\n    print(n)",
        max_processes=16,
    )
    big = run_python(
        "try:\n    open('f', 'wb').write(b'x' * (8 << 20))\nexcept OSError as e:\n    print(e.errno)", file_mb=1
    )
    output = run_python("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))", max_output=1 << 16)
    return [
        {"limit": "memory (RLIMIT_AS 256 MiB, 2 GiB asked)", "held": memory.killed == "memory", "s": memory.seconds},
        {"limit": "cpu (RLIMIT_CPU 1 s, endless loop)", "held": cpu.killed == "cpu", "s": cpu.seconds},
        {
            "limit": "processes (16, fork loop)",
            "held": fork.stdout.strip().isdigit() and int(fork.stdout) < 16,
            "s": fork.seconds,
        },
        {
            "limit": "file size (RLIMIT_FSIZE 1 MiB, 8 MiB written)",
            "held": big.stdout.strip() == "27",
            "s": big.seconds,
        },
        {
            "limit": "output (64 KiB cap, 64 MiB printed)",
            "held": output.truncated and len(output.stdout) == 1 << 16,
            "s": output.seconds,
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 calls each instead of 30")
    args = parser.parse_args()
    n = 8 if args.quick else 30
    run_python("pass")  # first call builds the seccomp filter
    sandboxed = median_seconds(lambda: run_python("print(1)"), n)
    plain = median_seconds(
        lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True), n
    )
    checks = limits()
    print(f"per call, median of {n}: sandbox {sandboxed * 1000:.1f} ms, plain subprocess {plain * 1000:.1f} ms, "
          f"ratio {sandboxed / plain:.1f}x")  # fmt: skip
    print(f"{'limit':52} {'held':>5} {'seconds':>8}")
    for row in checks:
        print(f"{row['limit']:52} {str(row['held']):>5} {row['s']:8.2f}")
    result = {
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/sandbox.py" + (" --quick" if args.quick else ""),
        "calls": n,
        "median_s": {"sandbox": round(sandboxed, 4), "plain_subprocess": round(plain, 4)},
        "overhead_ratio": round(sandboxed / plain, 2),
        "limits": checks,
    }
    out = Path(__file__).parent / "results" / "sandbox.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not all(row["held"] for row in checks):
        sys.exit("a limit did not hold")


if __name__ == "__main__":
    main()
