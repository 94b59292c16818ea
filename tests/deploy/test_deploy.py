"""deploy/ checked offline with the tools an operator's CI would run: hadolint on the images,
the compose spec's JSON schema, Kubernetes' own schemas (strict), and the dashboard's queries
against the metric names /metrics really serves. And the CURVE keys: which files the engine and
the frontends mount, and that those files, laid out as compose's `keys` service and the
Kubernetes Secret's `items` lay them out, are what shared/curve.py loads and admits."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from frontend.cli import main as tandem
from frontend.metrics import render
from shared.curve import client_keys, secure_client, secure_server, server_keys
from shared.messages import EngineStats

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
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
    text = render([(0, EngineStats())], "m").decode()
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


# --- CURVE keys -----------------------------------------------------------------------------

ENGINE_HALF = {"engine.key_secret", "frontend.key"}  # what shared/curve.py's server side loads
FRONTEND_HALF = {"frontend.key_secret", "engine.key"}  # and its client side


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} not given once in {argv}"
    return argv[argv.index(name) + 1]


def shake_hands(engine_folder: Path, frontend_folder: Path) -> bool:
    """Whether a frontend holding `frontend_folder` gets a frame through to an engine socket
    secured with `engine_folder`, as engine_core/process.py and frontend/engine/client.py do."""
    server_keys(engine_folder)  # what the engine checks at start-up
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth = secure_server(ctx, router, engine_folder)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        with ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDTIMEO, 2000)
            secure_client(dealer, client_keys(frontend_folder))
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"hello")
            return bool(router.poll(2000)) and router.recv_multipart()[1] == b"hello"
    finally:
        auth.stop()
        router.close()
        ctx.term()


def test_no_key_file_is_kept_in_deploy() -> None:
    kept = [p for p in DEPLOY.rglob("*") if p.suffix in (".key", ".key_secret")]
    assert not kept, f"key files committed under deploy/: {kept}"


# compose: the one-shot `keys` service writes each half into its own named volume

def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    return services


def compose_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) for a service's short-syntax volumes."""
    mounts = {}
    for entry in service["volumes"]:
        readonly = entry.endswith(":ro")
        source, target = entry.removesuffix(":ro").removesuffix(":rw").rsplit(":", 1)
        mounts[target] = (source, readonly)
    return mounts


def compose_key_volume(service: dict[str, Any]) -> str:
    """The named volume a service mounts read-only where its --curve-keys points."""
    folder = flag(service["command"], "--curve-keys")
    source, readonly = compose_mounts(service)[folder]
    assert readonly, f"{folder} is mounted writable"
    volumes = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["volumes"]
    assert source in volumes, f"{source} is not one of the file's named volumes"
    return source


def test_compose_engine_and_frontends_use_their_own_key_volume() -> None:
    services = compose_services()
    engine, frontend = (compose_key_volume(services[s]) for s in ("engine", "frontend"))
    assert engine != frontend  # a frontend container never sees the engine's secret key
    keys = services["keys"]
    assert services["engine"]["depends_on"]["keys"] == {
        "condition": "service_completed_successfully"}
    assert "restart" not in keys and "ports" not in keys  # a one-shot, on no network
    assert keys["network_mode"] == "none"
    written = {source for source, readonly in compose_mounts(keys).values() if not readonly}
    assert {engine, frontend} <= written


def run_keys_service(folders: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    """compose's `keys` service, run here: its script with each of its mounts (volumes and
    tmpfs) mapped to the folder `folders` names for it. Not root: without chown."""
    keys = compose_services()["keys"]
    script = keys["command"][0]
    assert "$" not in script.replace("$$", ""), "a lone $ would be interpolated by compose"
    script = script.replace("$$", "$")
    paths = {target: folders[source] for target, (source, _) in compose_mounts(keys).items()}
    paths.update({target: folders["tmpfs"] for target in keys["tmpfs"]})
    pattern = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
    script = re.sub(rf"(?<![\w./-])({pattern})(?![\w.-])", lambda m: str(paths[m[1]]), script)
    if os.geteuid() != 0:
        assert "-o 1000 -g 1000 " in script and "chown 1000:1000 " in script
        script = script.replace("-o 1000 -g 1000 ", "").replace("chown 1000:1000 ", "true ")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([*keys["entrypoint"], script], env=env, capture_output=True, text=True,
                          timeout=120)


def test_compose_keys_service_makes_loadable_private_halves_once(tmp_path: Path) -> None:
    services = compose_services()
    engine_volume = compose_key_volume(services["engine"])
    frontend_volume = compose_key_volume(services["frontend"])
    folders = {name: tmp_path / name for name in (engine_volume, frontend_volume, "tmpfs")}
    for folder in folders.values():
        folder.mkdir()
    engine, frontend = folders[engine_volume], folders[frontend_volume]

    done = run_keys_service(folders)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in engine.iterdir()} == ENGINE_HALF
    assert {p.name for p in frontend.iterdir()} == FRONTEND_HALF
    for folder in (engine, frontend):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        for file in folder.iterdir():
            assert stat.S_IMODE(file.stat().st_mode) == 0o400
            if os.geteuid() == 0:  # the images' user
                assert (file.stat().st_uid, file.stat().st_gid) == (1000, 1000)
    assert shake_hands(engine, frontend)

    before = {p: p.read_bytes() for p in [*engine.iterdir(), *frontend.iterdir()]}
    again = run_keys_service(folders)
    assert again.returncode == 0 and "keeping" in again.stdout, again.stderr
    assert {p: p.read_bytes() for p in [*engine.iterdir(), *frontend.iterdir()]} == before

    (frontend / "engine.key").unlink()  # an incomplete set: refused, nothing replaced
    broken = run_keys_service(folders)
    assert broken.returncode != 0 and "incomplete" in broken.stderr
    del before[frontend / "engine.key"]
    assert {p: p.read_bytes() for p in [*engine.iterdir(), *frontend.iterdir()]} == before


# Kubernetes: one Secret made from `tandem keys` output; each pod mounts its half (items)

def pod_spec(manifest: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((K8S / manifest).read_text())["spec"]["template"]["spec"]
    return spec


def k8s_key_secret(manifest: str) -> dict[str, Any]:
    """The secret volume the pod's container mounts read-only where its --curve-keys points."""
    spec = pod_spec(manifest)
    (container,) = spec["containers"]
    folder = flag(container["args"], "--curve-keys")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount.get("readOnly") is True and "subPath" not in mount
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret: dict[str, Any] = volume["secret"]
    return secret


def k8s_items(manifest: str) -> dict[str, str]:
    return {item["key"]: item["path"] for item in k8s_key_secret(manifest)["items"]}


@pytest.mark.parametrize("manifest", ["engine.yaml", "frontend.yaml"])
def test_k8s_pods_mount_the_keys_read_only_and_private(manifest: str) -> None:
    secret = k8s_key_secret(manifest)
    assert secret["secretName"] == k8s_key_secret("engine.yaml")["secretName"]
    assert secret.get("optional") is not True  # no keys: the pod waits, never serves open
    mode = secret["defaultMode"]
    assert mode & 0o222 == 0 and mode & 0o007 == 0, oct(mode)  # nobody writes, others read not
    # the files are root's; with fsGroup the kubelet gives them to the pod's group to read
    assert pod_spec(manifest)["securityContext"]["fsGroup"] == 1000


def test_k8s_each_pod_gets_only_its_half() -> None:
    assert set(k8s_items("engine.yaml")) == ENGINE_HALF
    assert set(k8s_items("frontend.yaml")) == FRONTEND_HALF


def test_docs_create_the_secret_the_pods_mount() -> None:
    name = k8s_key_secret("engine.yaml")["secretName"]
    docs = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    assert f"kubectl create secret generic {name} --from-file=" in docs


def kubelet_secret_volume(secret: Path, items: dict[str, str], folder: Path) -> Path:
    """`folder` laid out as the kubelet writes a secret volume with `items`: the files in a
    timestamped folder behind the `..data` link, and a link per path (its atomic writer)."""
    data = folder / "..2025_01_01_00_00_00.000000000"
    data.mkdir(parents=True)
    (folder / "..data").symlink_to(data.name)
    for key, path in items.items():
        (data / path).write_bytes((secret / key).read_bytes())
        (folder / path).symlink_to(f"..data/{path}")
    return folder


def test_k8s_secret_from_tandem_keys_loads_and_admits_the_frontends(tmp_path: Path) -> None:
    # `kubectl create secret generic NAME --from-file=DIR`: a key per file of DIR, by its name
    assert tandem(["keys", str(tmp_path / "tandem-keys")]) == 0
    secret = tmp_path / "tandem-keys"
    engine = kubelet_secret_volume(secret, k8s_items("engine.yaml"), tmp_path / "engine")
    frontend = kubelet_secret_volume(secret, k8s_items("frontend.yaml"), tmp_path / "frontend")
    assert shake_hands(engine, frontend)
