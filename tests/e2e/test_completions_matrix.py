"""/v1/completions end to end through `tandem serve`, with the openai SDK as the client.

The matrix: stream x echo x logprobs {none, 0, 1, 5} x n {1, 2} x stop {none, set} x
max_tokens {0, 1, 16} over ASCII, CJK and emoji prompts, served as outputs come, with every
stream merging engine steps into its chunks, with speculative decoding, and at
--tensor-parallel-size 2. For every cell the streamed and the non-streamed answers agree, the
text-offset contract holds, the final text equals tokenizer.decode of the generated ids, and
prompt-only logprobs equal Hugging Face's.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.server import Server

PROMPTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. Then",
    "cjk": "你好，世界。今天天气很好，我们去",
    "emoji": "Party time 🎉🚀 with friends 👩‍👩‍👧 and",
}
LOGPROBS = (None, 0, 1, 5)
ATOL = 1e-4


# The matrix runs three times: as outputs come; with every stream merging 2 engine steps into
# each chunk (the test-only --merge-steps), so the merged path of a stream that fell behind is
# checked against the same references even on a machine fast enough never to fall behind; and
# with speculative decoding, the model as its own draft, so that most steps bring each request
# several tokens (its accepted drafts and one more) as rows of one engine message, and steps
# overlapped (--async-scheduling) while more requests run than speculation's bound; and with
# the model split over two ranks (--tensor-parallel-size 2: the engine and one gloo worker),
# whose outputs must keep the same contract.
@pytest.fixture(scope="module", params=["as-they-come", "merged", "speculative",
                                        "tensor-parallel"])
def server(tiny_llama: Path, tmp_path_factory, request):
    flags = {"as-they-come": ["--merge-steps", "1"], "merged": ["--merge-steps", "2"],
             "speculative": ["--speculative-config", f'{{"model": "{tiny_llama}", '
                             '"num_speculative_tokens": 3, "disable_by_batch_size": 8}',
                             "--async-scheduling"],
             "tensor-parallel": ["--tensor-parallel-size", "2", "--device", "cpu"],
             }[request.param]
    srv = Server(
        tiny_llama, tmp_path_factory.mktemp("srv"), "--max-model-len", "512", *flags,
    ).wait_healthy()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@dataclass
class Choice:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    has_logprobs: bool = False

    def absorb(self, c) -> None:
        self.text += c.text
        if c.logprobs is not None:
            self.has_logprobs = True
            self.tokens += c.logprobs.tokens or []
            self.token_logprobs += c.logprobs.token_logprobs or []
            self.top_logprobs += c.logprobs.top_logprobs or []
            self.text_offset += c.logprobs.text_offset or []
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason


async def complete(
    client: openai.AsyncOpenAI, stream: bool, **kw
) -> tuple[dict[int, Choice], object]:
    choices: dict[int, Choice] = {}
    if not stream:
        resp = await client.completions.create(stream=False, **kw)
        for c in resp.choices:
            choices.setdefault(c.index, Choice()).absorb(c)
        return choices, resp.usage
    usage = None
    async for chunk in await client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            choices.setdefault(c.index, Choice()).absorb(c)
        if chunk.usage is not None:
            assert not chunk.choices, "usage comes on a final chunk with no choices"
            usage = chunk.usage
    return choices, usage


def assert_same(a: Choice, b: Choice) -> None:
    assert a.text == b.text
    assert a.tokens == b.tokens
    assert a.text_offset == b.text_offset
    assert a.finish_reason == b.finish_reason
    assert len(a.token_logprobs) == len(b.token_logprobs)
    for x, y in zip(a.token_logprobs, b.token_logprobs):
        assert (x is None) == (y is None) and (x is None or abs(x - y) <= ATOL)
    for x, y in zip(a.top_logprobs, b.top_logprobs):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys()


def assert_offsets(c: Choice, echo: bool) -> None:
    assert len(c.text_offset) == len(c.tokens) == len(c.token_logprobs)
    assert c.text_offset == sorted(c.text_offset), "offsets must not decrease"
    if echo and c.text_offset:
        assert c.text_offset[0] == 0
    for tok, off in zip(c.tokens, c.text_offset):
        if tok.isascii() and not tok.startswith(("<", "bytes:")) and off + len(tok) <= len(c.text):
            assert c.text[off:].startswith(tok), (tok, off, c.text)


def cases():
    for name, echo, logprobs, n, stop, max_tokens in itertools.product(
            PROMPTS, (False, True), LOGPROBS, (1, 2), (False, True), (0, 1, 16)):
        if max_tokens == 0 and not echo:
            continue
        yield name, echo, logprobs, n, stop, max_tokens


async def test_matrix_stream_equals_non_stream(server, tokenizer, tiny_llama):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                timeout=60)
    model = (await client.models.list()).data[0].id
    # Stop strings that really occur: a piece from the middle of each greedy continuation.
    stops = {}
    for name, prompt in PROMPTS.items():
        full = await client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0
        )
        text = full.choices[0].text
        stops[name] = [text[len(text) // 2: len(text) // 2 + 2]] if len(text) > 4 else ["\n\n"]
    sem = asyncio.Semaphore(16)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    async def cell(name, echo, logprobs, n, stop, max_tokens):
        kw = dict(model=model, prompt=PROMPTS[name], echo=echo, logprobs=logprobs, n=n,
                  max_tokens=max_tokens, temperature=0, stop=stops[name] if stop else None)
        async with sem:
            plain, usage = await complete(client, False, **kw)
            streamed, s_usage = await complete(client, True, **kw)
        label = (name, echo, logprobs, n, stop, max_tokens)
        assert sorted(plain) == sorted(streamed) == list(range(n)), label
        assert (
            usage.prompt_tokens == s_usage.prompt_tokens == len(tokenizer(PROMPTS[name]).input_ids)
        )
        assert usage.completion_tokens == s_usage.completion_tokens, label
        for i in range(n):
            a, b = plain[i], streamed[i]
            assert_same(a, b)
            assert a.has_logprobs == (logprobs is not None), label
            if logprobs is not None:
                assert_offsets(a, echo)
                assert all(t is None or len(t) >= 1 for t in a.top_logprobs)
            if echo:
                assert a.text.startswith(tokenizer.decode(tokenizer(PROMPTS[name]).input_ids,
                                                          skip_special_tokens=True)), label
            if max_tokens == 0:
                assert a.finish_reason == "length" and usage.completion_tokens == 0
                if logprobs is not None:
                    assert_prompt_logprobs(hf, tokenizer, PROMPTS[name], a)
        return label

    done = await asyncio.gather(*(cell(*c) for c in cases()))
    assert len(done) == 3 * (2 * 4 * 2 * 2 * 3 - 4 * 2 * 2)


def assert_prompt_logprobs(hf, tokenizer, prompt: str, c: Choice) -> None:
    ids = tokenizer(prompt).input_ids
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    expected = [None] + [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert len(c.token_logprobs) == len(ids)
    assert c.token_logprobs[0] is None and c.top_logprobs[0] is None
    assert c.token_logprobs[1:] == pytest.approx(expected[1:], abs=ATOL)


async def test_final_text_equals_tokenizer_decode(server, tokenizer):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                timeout=60)
    model = (await client.models.list()).data[0].id
    for prompt in PROMPTS.values():
        for stream in (False, True):
            ids_resp, _ = await complete(client, stream, model=model, prompt=prompt, max_tokens=24,
                                         temperature=0, logprobs=0,
                                         extra_body={"return_tokens_as_token_ids": True})
            c = ids_resp[0]
            ids = [int(t.split(":", 1)[1]) for t in c.tokens]
            assert len(ids) == 24
            assert c.text == tokenizer.decode(ids, skip_special_tokens=True)
            plain, _ = await complete(client, stream, model=model, prompt=prompt, max_tokens=24,
                                      temperature=0, logprobs=0)
            assert plain[0].text == c.text and plain[0].text_offset == c.text_offset


async def test_token_id_prompts_and_batches(server, tokenizer):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                timeout=60)
    model = (await client.models.list()).data[0].id
    ids = tokenizer("你好世界🎉").input_ids
    cut = ids[:-1]  # may end inside a character: nothing of the prompt may leak into the text
    resp = await client.completions.create(model=model, prompt=[cut, ids], max_tokens=4,
                                           temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == len(cut) + len(ids)  # once per prompt, whatever n
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt=[[10**8]], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model=model, prompt="hi " * 600, max_tokens=4)
    assert "512" in str(too_long.value)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


async def test_the_speculative_server_verified_and_accepted_drafts(server, request):
    """The matrix above ran through speculation: the server's vLLM counters say drafts were
    verified and, the model being its own draft, every one accepted."""
    if request.node.callspec.params["server"] != "speculative":
        pytest.skip("only the speculative server speculates")
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/metrics") as response:
            text = await response.text()
    counts = {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{"))
              for name in ("vllm:spec_decode_num_draft_tokens_total",
                           "vllm:spec_decode_num_accepted_tokens_total")}
    drafted = counts["vllm:spec_decode_num_draft_tokens_total"]
    assert drafted > 100 and counts["vllm:spec_decode_num_accepted_tokens_total"] == drafted
