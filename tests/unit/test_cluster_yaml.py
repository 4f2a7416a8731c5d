"""cluster.yaml is what users give to ``ray up``: it must pass Ray's own schema."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).parents[2] / "cluster.yaml"


def test_cluster_yaml_passes_rays_schema() -> None:
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(config))  # raises on any schema error


def test_head_runs_etcd_and_every_node_advertises_pool_capacity_and_joins() -> None:
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    head, workers = " ".join(config["head_start_ray_commands"]), " ".join(config["worker_start_ray_commands"])
    assert "kvpool etcd" in head
    assert "--host $KVPOOL_HEAD" in head and f"KVPOOL_HEAD={config['provider']['head_ip']}" in head
    for commands in (head, workers):
        assert "kvpool_dram_mib" in commands and "kvpool_nvme_mib" in commands
        assert "kvpool join" in commands and "ray stop" not in commands
    assert "torch==2.13.0" in " ".join(config["setup_commands"])


def test_the_commented_aws_variant_passes_rays_schema_too() -> None:
    text = CLUSTER_YAML.read_text()
    block = text[text.index("# provider: {type: aws") : text.index("# (with available_node_types")]
    aws = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    config = {**yaml.safe_load(text), **aws}
    del config["max_workers"]  # per node type now
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "aws" and "kvpool_dram_mib" in str(config["available_node_types"])
