"""cluster.yaml passes the Ray autoscaler's own schema validation, has the node types the
README promises, and is locked down: token authentication on every node, the dashboard and
job API on the head's loopback only, no cluster port open to the internet."""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

pytestmark = pytest.mark.timeout(60)

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
TOKEN_FILE = "~/.ray/auth_token"  # in the container: Ray expands ~ there
OPEN_TO_ALL = {"0.0.0.0/0", "::/0"}


def raw_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def all_strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in all_strings(k) + all_strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in all_strings(v)]
    return [node] if isinstance(node, str) else []


def all_commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
    keys += ("head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for k in keys for c in config.get(k, [])]
    for node_type in config.get("available_node_types", {}).values():
        commands += [c for k in keys for c in node_type.get(k, [])]
    return commands


def open_ingress(config: dict) -> list[str]:
    """Security-group rules anywhere in the file that admit the whole internet to a port other
    than SSH."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "IpPermissions" in node:
                for rule in node["IpPermissions"]:
                    cidrs = {r.get("CidrIp") for r in rule.get("IpRanges", [])}
                    cidrs |= {r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])}
                    if cidrs & OPEN_TO_ALL and not rule.get("FromPort") == rule.get("ToPort") == 22:
                        found.append(f"ports {rule.get('FromPort')}-{rule.get('ToPort')} open to {cidrs & OPEN_TO_ALL}")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(config)
    return found


def security_problems(config: dict) -> list[str]:
    """What makes a cluster definition unsafe to run; empty when it is locked down."""
    problems = []
    for s in all_strings(config):
        if "0.0.0.0" in s and "0.0.0.0/0" not in s:
            problems.append(f"binds every interface: {s!r}")
        if re.search(r"RAY_AUTH_MODE\s*=\s*(?!token\b)", s):
            problems.append(f"turns token authentication off: {s!r}")
        if re.search(r"RAY_AUTH_TOKEN\s*[=:]", s):
            problems.append(f"puts a token in the file itself: {s!r}")
    for command in all_commands(config):
        for part in re.split(r"&&|;|\|\|", command):
            if re.search(r"\bray start\b", part) and not re.search(r"\bRAY_AUTH_MODE=token\s+\S*ray start\b", part):
                problems.append(f"starts Ray without RAY_AUTH_MODE=token: {command!r}")
        if re.search(r"\bray start\b", command) and "test -s ~/.ray/auth_token" not in command:
            problems.append(f"starts Ray without first checking that the token is there: {command!r}")
    head = " ".join(config.get("head_start_ray_commands", []))
    if "--dashboard-host=127.0.0.1" not in head or len(re.findall(r"--dashboard-host", head)) != 1:
        problems.append("the head's dashboard is not bound to 127.0.0.1 (exactly one --dashboard-host=127.0.0.1)")
    if not config.get("worker_start_ray_commands") or not config.get("head_start_ray_commands"):
        problems.append("the head and workers need explicit start commands (Ray's defaults start without auth)")
    if config.get("file_mounts", {}).get(TOKEN_FILE) != "~/.ray/auth_token":
        problems.append(f"the token is not mounted at {TOKEN_FILE} from the operator's ~/.ray/auth_token")
    problems += open_ingress(config)
    return problems


def test_cluster_yaml_is_valid_for_the_ray_autoscaler():
    config = prepare_config(raw_config())
    validate_config(config)  # raises jsonschema.ValidationError on any schema violation
    types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert types["cpu_worker"]["max_workers"] > types["cpu_worker"]["min_workers"] == 0  # autoscaling
    assert "p4d" in types["gpu_worker"]["node_config"]["InstanceType"]
    # every node runs lmfoundry's images (docker/); nothing is installed on the nodes
    assert config["docker"]["image"].endswith("/lmfoundry:0.1.0-cpu")
    assert types["gpu_worker"]["docker"]["worker_image"].endswith("/lmfoundry:0.1.0-cuda")
    assert "pip install" not in " ".join(all_commands(raw_config()))  # (Ray adds boto3 to the head itself)


def test_validation_catches_a_broken_cluster_yaml():
    raw = raw_config()
    raw["available_node_types"]["head"]["bogus_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(raw))


def test_cluster_yaml_has_token_auth_loopback_dashboard_and_no_open_ports():
    assert security_problems(raw_config()) == []
    assert security_problems(prepare_config(raw_config())) == []  # as the launcher will run it


def _mutated(edit) -> dict:
    config = copy.deepcopy(raw_config())
    edit(config)
    return config


def _replace_in(key: str, old: str, new: str):
    def edit(config):
        config[key] = [c.replace(old, new) for c in config[key]]

    return edit


ATTACKS = {
    "dashboard_on_all_interfaces": _replace_in("head_start_ray_commands", "127.0.0.1", "0.0.0.0"),
    "dashboard_flag_dropped": _replace_in("head_start_ray_commands", "--dashboard-host=127.0.0.1", ""),
    "head_started_without_auth": _replace_in("head_start_ray_commands", "RAY_AUTH_MODE=token ray start", "ray start"),
    "worker_started_without_auth": _replace_in(
        "worker_start_ray_commands", "RAY_AUTH_MODE=token ray start", "ray start"
    ),
    "auth_disabled": _replace_in("worker_start_ray_commands", "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled"),
    "token_check_dropped": _replace_in("worker_start_ray_commands", "test -s ~/.ray/auth_token && ", ""),
    "auth_in_a_later_command_only": _replace_in(
        "head_start_ray_commands", "RAY_AUTH_MODE=token ray start", "ray start; RAY_AUTH_MODE=token true"
    ),
    "worker_start_left_to_ray_defaults": lambda c: c.pop("worker_start_ray_commands"),
    "token_pasted_into_the_file": lambda c: c.setdefault("initialization_commands", []).append(
        "export RAY_AUTH_TOKEN=abc"
    ),
    "token_not_mounted": lambda c: c["file_mounts"].pop(TOKEN_FILE),
    "serve_on_all_interfaces": lambda c: c["setup_commands"].append("serve start --http-host 0.0.0.0"),
    "dashboard_port_open_to_the_internet": lambda c: c["provider"].update(
        security_group={
            "GroupName": "lmfoundry",
            "IpPermissions": [
                {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
            ],
        }
    ),
    "gcs_port_open_over_ipv6": lambda c: c["available_node_types"]["head"]["node_config"].update(
        NetworkInterfaces=[
            {"Groups": [{"IpPermissions": [{"FromPort": 6379, "ToPort": 6379, "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}]}]}
        ]
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_unsafe_cluster_definition_is_caught(attack):
    assert security_problems(_mutated(ATTACKS[attack])) != []


def test_ssh_only_open_to_all_is_allowed():
    def ssh_only(config):
        config["provider"]["security_group"] = {
            "GroupName": "lmfoundry",
            "IpPermissions": [
                {"FromPort": 22, "ToPort": 22, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
            ],
        }

    assert security_problems(_mutated(ssh_only)) == []
