"""The package as users get it: the CLI's help, version and config listing; a wheel built from this
checkout installed into a fresh virtual environment; the container images' pins (docker/, checked
offline: no Docker engine runs here, so no image is built)."""

from __future__ import annotations

import importlib.metadata
import re
import resource
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib

from lmfoundry.platform.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "deepspeed", "pyarrow")  # what a --help must not wait for
pytestmark = pytest.mark.timeout(300)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirement(name: str) -> str:
    """pyproject's requirement string for `name`, e.g. 'deepspeed>=0.19,<0.20'."""
    (found,) = [r for r in pyproject()["project"]["dependencies"] if re.match(rf"{name}\b", r)]
    return found


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float, set[str]]:
    """Runs `lmfoundry ARGS`: the result, the CPU seconds it took (user + system: what the command
    costs, not what a loaded machine's scheduler adds) and the heavy packages it imported."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lmfoundry.platform.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imported = {m for m in re.findall(r"^import time:.*\|\s*(\S+)$", r.stderr, re.M) if m in HEAVY}
    return r, cpu, imported


def test_help_for_every_command_is_on_stdout_within_a_second_and_names_recipes_that_exist():
    top, cpu, imported = cli("--help")
    assert top.returncode == 0 and top.stdout.startswith("The `lmfoundry` command"), top.stderr[-2000:]
    assert cpu < 1.0 and not imported, (cpu, imported)
    for command in COMMANDS:
        r, cpu, imported = cli(command, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: lmfoundry {command}"), (command, r.stderr[-2000:])
        assert not imported, f"lmfoundry {command} --help imported {sorted(imported)}"
        assert cpu < 1.0, f"lmfoundry {command} --help took {cpu:.2f} CPU seconds"
        assert not imported - {"pyarrow"} if command in ("keys", "traffic") else not imported, (command, imported)
        recipes = re.findall(r"configs/[\w./-]+\.yaml", r.stdout)
        assert all((REPO / p).is_file() for p in recipes), (command, recipes)
        if COMMANDS[command].is_stage:
            assert COMMANDS[command].recipe in recipes, (command, r.stdout)
    unknown = subprocess.run([sys.executable, "-m", "lmfoundry.platform.cli", "bogus"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown command 'bogus'" in unknown.stderr and unknown.stdout == ""


def test_version_is_the_package_version():
    import lmfoundry

    r, _, imported = cli("--version")
    assert r.stdout.strip() == f"lmfoundry {lmfoundry.__version__}" and not imported
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lmfoundry.__version__"}


def test_config_show_lists_every_key_with_type_default_and_description(capsys):
    from lmfoundry.jobs.config import config_rows, main, stage_config

    assert main(["show", "serve"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^engine\.max_batch_size\s+int\s+16\s+requests decoded together.*\(ge=1\)$", out, re.M)
    assert re.search(r"^versions\[\]\.weight\s+float\s+0\.0\s+share of traffic", out, re.M)
    assert re.search(r"^rate_limits\.tenants\.NAME\.requests_per_minute\s+int \| None\s+null", out, re.M)
    for stage, command in COMMANDS.items():
        if command.is_stage:
            rows = config_rows(stage_config(stage))
            assert rows and all(key and kind and default for key, kind, default, _ in rows), stage
    with pytest.raises(SystemExit):
        main(["show", "nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_extras_and_bounds_are_what_the_code_relies_on():
    project = pyproject()["project"]
    assert {"gpu", "vllm", "postgres", "bench", "dev"} <= set(project["optional-dependencies"])
    assert requirement("ray") == "ray[train,data,serve]==2.60.0"
    assert requirement("deepspeed") == "deepspeed>=0.19,<0.20"  # internals: train/snapshot.py, pipeline_parallel.py
    import deepspeed
    import ray

    assert ray.__version__ == "2.60.0"
    assert tuple(int(x) for x in deepspeed.__version__.split(".")[:2]) < (0, 20)


def test_a_built_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    """The wheel is built from this checkout and installed without its dependencies into a new
    virtual environment that sees this one's packages (a .pth file): `pip check` there then
    resolves the wheel's declared requirements, bounds included, against a working set, and the
    command runs from the installed wheel, not from the checkout."""
    # built from what the images copy (pyproject.toml, README.md, lmfoundry/), outside the checkout:
    # an in-tree build would leave build/ behind
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(REPO / "lmfoundry", src / "lmfoundry", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("lmfoundry-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    # only now the dependencies: pip installed into an environment that held nothing else (it must
    # never see, let alone replace, the lmfoundry these tests run from)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
    clean = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH: the wheel only
    where = subprocess.run(
        [
            python,
            "-c",
            "import lmfoundry, importlib.resources as r; print(lmfoundry.__file__); "
            "print(r.files('lmfoundry.eval').joinpath('suites').is_dir())",
        ],
        capture_output=True,
        text=True,
        env=clean,
        cwd=tmp_path,
    )
    file, suites = where.stdout.split()
    assert file.startswith(site) and suites == "True", where.stdout + where.stderr
    version = subprocess.run([env_dir / "bin" / "lmfoundry", "--version"], capture_output=True, text=True, env=clean)
    assert version.stdout.strip() == f"lmfoundry {importlib.metadata.version('lmfoundry')}", version.stderr
    shown = subprocess.run(
        [env_dir / "bin" / "lmfoundry", "config", "show", "pack"],
        capture_output=True,
        text=True,
        env=clean,
        cwd=tmp_path,
    )
    assert re.search(r"^seq_len\s+int", shown.stdout, re.M), shown.stderr[-2000:]
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, env=clean)
    assert not [line for line in check.stdout.splitlines() if line.lower().startswith("lmfoundry ")], check.stdout


def dockerfile(name: str) -> str:
    return (REPO / "docker" / name).read_text()


@pytest.mark.parametrize(
    "name, torch_index, extras", [("Dockerfile.cpu", "cpu", "postgres"), ("Dockerfile.cuda", "cu128", "gpu,postgres")]
)
def test_dockerfiles_install_the_package_pins_as_non_root_with_the_entry_point(name, torch_index, extras):
    text = dockerfile(name)
    base = re.search(r"^FROM rayproject/ray:(\S+)-py\d+-(\w+)$", text, re.M)
    assert base and base.group(1) == requirement("ray").split("==")[1] and base.group(2) == torch_index, base
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0") and text.index(f"USER {users[-1]}") < text.index("RUN ")
    makefile_torch = re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f'"{makefile_torch}" --index-url https://download.pytorch.org/whl/{torch_index}' in text
    assert f'--no-build-isolation "{requirement("deepspeed")}"' in text
    assert f'"/tmp/lmfoundry-src[{extras}]"' in text
    assert set(extras.split(",")) <= set(pyproject()["project"]["optional-dependencies"])
    assert "-e " not in text and "pip install -e" not in text  # installed, not editable
    assert re.search(r"^RUN lmfoundry --version", text, re.M)  # the entry point answers in the image
    # configs/ where the RayJobs' runtime env ships it from, under the tag the manifests pull
    assert "WORKDIR /home/ray/lmfoundry\nCOPY --chown=ray:users configs/ configs/" in text
    from lmfoundry import __version__

    flavour = name.split(".")[1]
    assert f"-t registry.example.com/lmfoundry:{__version__}-{flavour} ." in text
    for manifest in [*(REPO / "deploy" / "kuberay").glob("*.yaml"), REPO / "cluster.yaml"]:
        for tag in re.findall(r"registry\.example\.com/lmfoundry:([\w.-]+)", manifest.read_text()):
            assert tag in (f"{__version__}-cpu", f"{__version__}-cuda"), (manifest.name, tag)
