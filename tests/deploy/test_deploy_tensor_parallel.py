"""The tensor-parallel node (`deploy/k8s/multi-gpu-tensor-parallel/`, a kustomize overlay of
`multi-gpu/`) checked offline: the overlay built here (its JSON patch applied to the base's
manifests by the test's own code, and by kustomize itself where kubectl is installed), the result
valid against Kubernetes' schemas (strict), the pod's GPUs exactly data parallel x tensor
parallel, its command line one `tandem serve` accepts, and every engine placed on its own
adjacent GPUs by the launcher's own rule. The compose file's TP example, likewise."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from frontend.cli import build_parser
from frontend.placement import plan
from shared.engine_args import check_engine_args
from tests.deploy.test_deploy_data_parallel import DEPLOY, container, flag, run, tool

BASE = DEPLOY / "k8s" / "multi-gpu"
OVERLAY = DEPLOY / "k8s" / "multi-gpu-tensor-parallel"


def kustomization(folder: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return loaded


def base_documents() -> list[dict[str, Any]]:
    return [d for name in kustomization(BASE)["resources"]
            for d in yaml.safe_load_all((BASE / name).read_text()) if d]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902's `replace` (the only op the overlay uses): the path must exist."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "replace", op
        *parents, last = op["path"].lstrip("/").split("/")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        index: Any = int(last) if isinstance(node, list) else last
        node[index]  # noqa: B018  (a replace of a path that is not there is an error)
        node[index] = op["value"]
    return doc


def built() -> list[dict[str, Any]]:
    """The overlay's manifests: the base's, each patch applied to the documents it targets."""
    overlay = kustomization(OVERLAY)
    assert overlay["resources"] == [f"../{BASE.name}"]
    docs = base_documents()
    for patch in overlay["patches"]:
        target = patch["target"]
        hits = [i for i, d in enumerate(docs) if d["kind"] == target["kind"]
                and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, target
        docs[hits[0]] = apply_json_patch(docs[hits[0]], yaml.safe_load(patch["patch"]))
    return docs


def deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == "Deployment"]
    return found


def test_the_overlay_validates_strictly(tmp_path: Path) -> None:
    out = tmp_path / "built.yaml"
    out.write_text(yaml.safe_dump_all(built()))
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", "1.33.0", str(out))


def test_every_engine_gets_its_own_adjacent_gpus() -> None:
    tandem = container(deployment(built()))
    argv = tandem["args"]
    dp, tp = int(flag(argv, "--data-parallel-size")), int(flag(argv, "--tensor-parallel-size"))
    assert tp == 2 and dp > 1
    gpus = {tandem["resources"][k]["nvidia.com/gpu"] for k in ("requests", "limits")}
    assert gpus == {str(dp * tp)}
    args = build_parser().parse_args(argv)  # the command line `tandem serve` is given
    assert check_engine_args(args) is None
    assert (args.data_parallel_size, args.tensor_parallel_size) == (dp, tp)
    visible = ",".join(str(g) for g in range(dp * tp))
    places = plan(dp, "ipc:///tmp/engine.sock", "cuda", {"CUDA_VISIBLE_DEVICES": visible},
                  cpus=range(16), tensor_parallel=tp)
    assert [p.cuda_device for p in places] == [f"{2 * k},{2 * k + 1}" for k in range(dp)]
    # the base's probes, volumes and /dev/shm (NCCL's) are kept
    base = container(deployment(base_documents()))
    assert {k: v for k, v in tandem.items() if k != "args"} == {
        k: v for k, v in base.items() if k != "args"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kustomize_builds_what_the_test_builds() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = deployment(list(yaml.safe_load_all(done.stdout)))
    ours = deployment(built())
    assert container(theirs) == container(ours)
    assert theirs["spec"]["template"]["spec"]["volumes"] == ours["spec"]["template"]["spec"][
        "volumes"]


def test_the_compose_files_tensor_parallel_example_fits_its_gpus() -> None:
    compose = yaml.safe_load((DEPLOY / "compose-multi-gpu.yaml").read_text())
    command = compose["services"]["tandem"]["command"]
    assert flag(command, "--tensor-parallel-size") == "${TP:-1}"
    example = next(line for line in (DEPLOY / "compose-multi-gpu.yaml").read_text().splitlines()
                   if "TP=2" in line and "docker compose" in line)
    dp = int(example.split("DP=")[1].split()[0])
    places = plan(dp, "ipc:///tmp/engine.sock", "cuda",
                  {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8)))}, cpus=range(16),
                  tensor_parallel=2)
    assert len({g for p in places for g in (p.cuda_device or "").split(",")}) == 2 * dp
