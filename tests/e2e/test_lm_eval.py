"""lm-evaluation-harness as a real client of one `tandem serve`.

lm-eval's `local-completions` model scores (context, continuation) pairs through
/v1/completions (token-id prompts, echo=true, max_tokens=1, logprobs=1). Its loglikelihoods
must equal those of lm-eval's own Hugging Face backend (`HFLM`) on the same model within 1e-4
per request, BOS included in both, and so must its greedy flags. It runs twice: with the
Hugging Face tokenizer on the client (four requests in flight), and with the remote tokenizer
that reads the server's /tokenizer_info, /tokenize and /detokenize (prompts batched by four).

No task is run (no data set can be downloaded): `loglikelihood` gets hand-made instances.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lm_eval.api.instance import Instance  # type: ignore[import-untyped]
from lm_eval.models.huggingface import HFLM  # type: ignore[import-untyped]
from lm_eval.models.openai_completions import LocalCompletionsAPI  # type: ignore[import-untyped]
from transformers import AutoTokenizer

from tests.e2e.server import Server

ATOL = 1e-4
PAIRS = [
    ("The capital of France is", " Paris"),
    ("Hello", ", world!"),
    ("你好，", "世界"),
    ("Party time ", "🎉 yes"),  # the trailing space moves to the continuation
    ("", "Nothing before me"),  # an empty context is scored after BOS alone
    ("Question: 2+2=? Answer:", " 4"),
    ("東京は日本の", "首都です。"),
    ("emoji 👍🏽 and", " 🙂 more"),
]

Scores = list[tuple[float, bool]]


def instances(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """Nothing may try the network: not lm-eval, transformers, nor the server it starts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def server(offline: None, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("lm_eval"), "--max-model-len", "512")
    yield srv.wait_healthy()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(offline: None, tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def reference(offline: None, tiny_llama: Path) -> Scores:
    """lm-eval's own scores: the model run in-process by its Hugging Face backend."""
    hf = HFLM(pretrained=str(tiny_llama), dtype="float32", device="cpu", add_bos_token=True,
              batch_size=1)
    return hf.loglikelihood(instances(PAIRS), disable_tqdm=True)


def local_completions(server: Server, **kw: Any) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="m",
                               max_retries=1, timeout=60, **kw)


def assert_same_scores(got: Scores, reference: Scores) -> None:
    assert len(got) == len(reference) == len(PAIRS)
    for pair, (logprob, greedy), (ref_logprob, ref_greedy) in zip(PAIRS, got, reference):
        assert logprob == pytest.approx(ref_logprob, abs=ATOL), pair
        assert greedy == ref_greedy, pair


def test_huggingface_tokenizer_backend(
    server: Server, tiny_llama: Path, tokenizer: Any, reference: Scores
) -> None:
    lm = local_completions(server, tokenizer_backend="huggingface", tokenizer=str(tiny_llama),
                           add_bos_token=True, num_concurrent=4)
    assert lm.prefix_token_id == tokenizer.bos_token_id
    for context, _ in PAIRS:
        if context:
            assert lm.tok_encode(context)[0] == tokenizer.bos_token_id

    assert_same_scores(lm.loglikelihood(instances(PAIRS), disable_tqdm=True), reference)


def test_remote_tokenizer_backend(server: Server, tokenizer: Any, reference: Scores) -> None:
    lm = local_completions(server, tokenizer_backend="remote", batch_size=4, num_concurrent=1)
    remote = lm.tokenizer
    assert (remote.bos_token, remote.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    assert lm.prefix_token_id == tokenizer.bos_token_id
    assert lm.eot_token_id == tokenizer.eos_token_id
    for text in {c + x for c, x in PAIRS}:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert remote.encode(text) == ids
        assert remote.decode(ids) == tokenizer.decode(ids)

    # The remote tokenizer never adds BOS itself (it asks /tokenize for no special tokens);
    # written as text at the start of a context, the server's tokenizer reads it as BOS.
    with_bos = [(remote.bos_token + c if c else c, x) for c, x in PAIRS]
    for context, _ in with_bos:
        if context:
            assert lm.tok_encode(context)[0] == tokenizer.bos_token_id

    assert_same_scores(lm.loglikelihood(instances(with_bos), disable_tqdm=True), reference)
