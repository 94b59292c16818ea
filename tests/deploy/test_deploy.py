"""deploy/ checked offline with the tools an operator's CI would run: hadolint on the images,
the compose spec's JSON schema, Kubernetes' own schemas (strict), and the dashboard's queries
against the metric names /metrics really serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import render
from shared.messages import EngineStats

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("dockerfile", sorted((DEPLOY / "docker").glob("Dockerfile.*")),
                         ids=lambda p: p.name)
def test_images_pass_hadolint(dockerfile: Path) -> None:
    run(tool("hadolint"), str(dockerfile))


def test_compose_file_follows_the_compose_spec() -> None:
    run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
        str(DEPLOY / "compose.yaml"))


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_strictly(version: str) -> None:
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", version,
        *map(str, manifests()))


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in manifests()]


def served_metric_names() -> set[str]:
    """Every sample name /metrics serves (histograms' _bucket/_sum/_count, counters' _total)."""
    text = render(EngineStats(), "m").decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_query_names_served_metrics_only() -> None:
    dashboard = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {m for e in exprs for m in re.findall(r"\b(?:vllm|tandem):[a-z0-9_]+", e)}
    assert named, "the dashboard queries no metric"
    missing = named - served_metric_names()
    assert not missing, f"the dashboard queries metrics /metrics does not serve: {missing}"
    # each panel keeps one copy of the series every frontend serves
    assert all("max without (instance, pod" in e for e in exprs)
