"""The data-parallel layouts checked offline: one multi-GPU node (compose and Kubernetes: one
`tandem serve --data-parallel-size N` with N GPUs) and the Inference Extension example (an
InferencePool and its endpoint picker in front of several Tandem pods), the InferencePool
against its CRD's own schema (test data), the metric names the endpoint picker reads against
what /metrics serves, and the pods' KV-event settings against what the engine accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import render
from shared.kv_events import parse_kv_events_config
from shared.messages import EngineStats

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NODE = DEPLOY / "k8s" / "multi-gpu"
POOL = DEPLOY / "k8s" / "inference-pool"
CRD = ROOT / "tests" / "data" / "deploy" / "inferencepool-crd.yaml"
# What the endpoint picker scrapes from every pod by default (the Inference Extension's model
# server protocol: vLLM's names)
EPP_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running",
               "vllm:kv_cache_usage_perc", "vllm:cache_config_info")


def run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def documents(folder: Path) -> list[dict[str, Any]]:
    return [d for p in sorted(folder.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def one(folder: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in documents(folder) if d["kind"] == kind
                and (name is None or d["metadata"]["name"] == name)]
    return found


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} not given once in {argv}"
    return argv[argv.index(name) + 1]


def test_the_multi_gpu_compose_file_follows_the_compose_spec() -> None:
    run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
        str(DEPLOY / "compose-multi-gpu.yaml"))


@pytest.mark.parametrize("folder", [NODE, POOL], ids=lambda p: p.name)
def test_kubernetes_manifests_validate_strictly(folder: Path) -> None:
    files = [p for p in sorted(folder.glob("*.yaml")) if p.name != "kustomization.yaml"]
    core = [str(p) for p in files if "InferencePool" not in p.read_text()]
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", "1.33.0", *core)
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in files]


def test_one_node_runs_one_engine_per_gpu_it_asks_for() -> None:
    tandem = container(one(NODE, "Deployment"))
    gpus = {tandem["resources"][k]["nvidia.com/gpu"] for k in ("requests", "limits")}
    assert gpus == {flag(tandem["args"], "--data-parallel-size")}
    assert tandem["readinessProbe"]["httpGet"]["path"] == "/health"  # one engine serving
    assert tandem["livenessProbe"]["httpGet"]["path"] == "/version"  # engines restart inside


def strict(schema: Any) -> Any:
    """The CRD's schema as the API server applies it: fields it does not know are refused."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def inferencepool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = strict(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def test_the_inferencepool_follows_its_crd_and_names_the_tandem_pods() -> None:
    pool = one(POOL, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, inferencepool_schema())
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse a wrong pool
        jsonschema.validate({**pool, "spec": {**pool["spec"], "targetPort": 8000}},
                            inferencepool_schema())
    servers = one(POOL, "Deployment", "tandem-pool")
    labels = servers["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    http = [p["containerPort"] for p in container(servers)["ports"] if p["name"] == "http"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == http
    assert flag(container(servers)["args"], "--port") == str(http[0])


def test_the_endpoint_picker_is_where_the_pool_says_with_a_config_that_resolves() -> None:
    pool = one(POOL, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(POOL, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "http2"  # ext-proc is gRPC
    epp = one(POOL, "Deployment", "tandem-pool-epp")
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"][
        "labels"].items()
    args = container(epp)["args"]
    assert flag(args, "--pool-name") == pool["metadata"]["name"]
    assert not [a for a in args if a.endswith("-metric")], "the defaults are vLLM's names"
    config_path = Path(flag(args, "--config-file"))
    (mount,) = [m for m in container(epp)["volumeMounts"]
                if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in epp["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    config = yaml.safe_load(one(POOL, "ConfigMap", volume["configMap"]["name"])["data"][
        config_path.name])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} == declared
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= declared


def test_the_metrics_the_endpoint_picker_reads_are_served() -> None:
    text = render([(0, EngineStats(num_blocks=200, block_size=16))], "m").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(EPP_METRICS) <= set(families)
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "200"


def test_pool_pods_publish_kv_events_only_the_endpoint_picker_reaches() -> None:
    servers = one(POOL, "Deployment", "tandem-pool")
    tandem = container(servers)
    config = parse_kv_events_config(flag(tandem["args"], "--kv-events-config"))
    assert config.enabled and config.replay_endpoint is not None
    assert config.topic.startswith("kv@$(POD_IP)@")  # llm-d's topic: kv@<pod IP>@<model>
    (pod_ip,) = [e for e in tandem["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in tandem["ports"]}
    published = {int(e.rsplit(":", 1)[1]) for e in (config.endpoint, config.replay_endpoint)}
    assert published == {ports["kv-events"], ports["kv-replay"]}
    policy = one(POOL, "NetworkPolicy")
    for rule in policy["spec"]["ingress"]:
        opened = {p["port"] for p in rule["ports"]}
        if opened & published:
            epp_labels = one(POOL, "Deployment", "tandem-pool-epp")["spec"]["template"][
                "metadata"]["labels"]
            (source,) = rule["from"]
            assert source["podSelector"]["matchLabels"].items() <= epp_labels.items()
    assert json.loads(flag(tandem["args"], "--kv-events-config"))  # plain JSON for vLLM too
