"""The sandbox for untrusted code: each escape attempt is blocked or killed, and the caller goes on."""

import os

import pytest

from lmfoundry.safety.sandbox import run_python

pytestmark = pytest.mark.timeout(120)


def test_ordinary_code_runs_and_writes_only_in_its_scratch_directory():
    r = run_python(
        "open('out.txt', 'w').write('hi')\nprint(open('out.txt').read(), sum(range(5)))", files={"data.txt": "given"}
    )
    assert r.ok and r.stdout.split() == ["hi", "10"]
    assert run_python("print(open('data.txt').read())", files={"data.txt": "given"}).stdout.strip() == "given"
    with pytest.raises(ValueError, match="outside the scratch"):
        run_python("pass", files={"../x.txt": "no"})


@pytest.mark.parametrize(
    "name, code, expect",
    [
        ("network", "import socket\nsocket.create_connection(('93.184.216.34', 80), timeout=2)", "not permitted"),
        ("dns", "import socket\nsocket.getaddrinfo('example.com', 80)", "gaierror"),
        ("write outside", "open('/tmp/lmfoundry-sandbox-escape.txt', 'w').write('x')", "No such file"),
        ("remove outside", "import os\nos.remove('/etc/hostname')", "No such file"),
        ("fork bomb", "import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
        ("shell", "import subprocess\nsubprocess.run('ls /', shell=True)", "No such file"),
    ],
)
def test_escapes_are_refused(name, code, expect):
    r = run_python(code, timeout_s=10)
    assert not r.ok and expect in r.stderr, (name, r.stderr[-300:])
    assert not os.path.exists("/tmp/lmfoundry-sandbox-escape.txt")


def test_memory_blow_up_and_infinite_loops_are_killed():
    memory = run_python("x = bytearray(4 << 30)", memory_mb=256)
    assert memory.killed == "memory"
    loop = run_python("while True:\n    pass", timeout_s=30, cpu_s=1)
    assert loop.killed == "cpu" and loop.seconds < 30  # the CPU limit stopped it, not the wall clock
    sleeper = run_python("import time\ntime.sleep(60)", timeout_s=1)
    assert sleeper.killed == "timeout" and sleeper.seconds < 5
    assert run_python("print('still working')").stdout.strip() == "still working"  # the caller goes on
