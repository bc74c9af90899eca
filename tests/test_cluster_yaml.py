"""cluster.yaml passes the Ray autoscaler's own schema validation, and has the node types the
README promises."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def test_cluster_yaml_is_valid_for_the_ray_autoscaler():
    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    config = prepare_config(raw)
    validate_config(config)  # raises jsonschema.ValidationError on any schema violation
    types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert types["cpu_worker"]["max_workers"] > types["cpu_worker"]["min_workers"] == 0  # autoscaling
    assert "p4d" in types["gpu_worker"]["node_config"]["InstanceType"]
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "lmfoundry" in setup


def test_validation_catches_a_broken_cluster_yaml():
    import jsonschema
    import pytest

    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    raw["available_node_types"]["head"]["bogus_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(raw))
