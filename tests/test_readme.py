"""The README's open-model path, run as written: the lines of the fenced block that builds a tiny
checkpoint, imports, fine-tunes, evaluates and serves it, one after another in a fresh directory
(with the repository's configs). The serve line runs in the background on a port of its own and
answers one chat completion with the key it printed."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def open_model_block() -> list[str]:
    """The command lines of the README's fenced bash block that builds the sample checkpoint."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "lmfoundry.data.sample_checkpoint" in b]
    return [line for line in block.splitlines() if line.strip()]


def test_the_readme_open_model_path_runs_as_written(own_ray_serve_env, tmp_path):
    lines = open_model_block()
    assert [line.split()[1] if line.startswith("lmfoundry") else line.split()[2] for line in lines] == [
        "lmfoundry.data.sample_checkpoint",
        "import",
        "lmfoundry.data.sample_chats",
        "sft",
        "evaluate",
        "serve",
    ]
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = {**own_ray_serve_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("LMFOUNDRY_API_KEYS", None)  # the server makes its own key and prints it
    said = {}
    for line in lines[:-1]:
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        said[line.split()[1] if line.startswith("lmfoundry") else line.split()[2]] = done.stdout + done.stderr
    assert "starting an embedded local Ray" in said["sft"]
    assert "starting an embedded local Ray" not in said["evaluate"]  # no token shards: nothing for Ray to do
    assert json.loads((tmp_path / "work/tiny/model_config.json").read_text())["n_layer"] == 2
    report = json.loads((tmp_path / "work/sft-eval/eval.json").read_text())
    assert any(name.startswith("task.") for name in report["metrics"]), sorted(report["metrics"])

    port = free_port()
    server = subprocess.Popen(
        ["bash", "-c", f"exec {lines[-1].split('#')[0]} --set port={port}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # as from a terminal: Ctrl-C's default action, whatever this test process inherited (an
        # ignored SIGINT survives exec, and Python then never raises KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(server.stdout), daemon=True).start()
    try:
        key = wait_until(
            lambda: (
                next((line.strip() for line in output if re.fullmatch(r"sk-\S{20,}", line.strip())), None)
                or (server.poll() is not None and pytest.fail("".join(output)[-3000:]))
            ),
            300,
            "the server to print its key",
        )
        wait_until(lambda: _healthy(port), 120, lambda: "/health; the server said: " + "".join(output)[-3000:])
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "lmfoundry", "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 8},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C, as the README says
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C did not stop the server within 60 s:\n" + "".join(output)[-3000:])
        assert code in (0, -signal.SIGINT), "".join(output)[-3000:]
    finally:
        if server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
