"""`--speculative-config`, vLLM's JSON for speculative decoding, parsed and checked.

Two kinds of proposal: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max":
n, "prompt_lookup_min": m}` (the request's own earlier tokens: the continuation of the latest
earlier occurrence of its last n..m tokens), and `{"model": PATH_OR_ID,
"num_speculative_tokens": k}` (a small draft model sharing the target's tokenizer; vLLM's
`method: "draft_model"`). As vLLM sets them: a method is inferred from `model` when absent,
and the n-gram sizes default to 5 and 5, or to each other when one is given.
`disable_by_batch_size` (vLLM's older key) turns proposals off while more requests than it
run. The launcher checks the flag without torch (here), the engine reads the result.
"""

from __future__ import annotations

import msgspec

METHODS = ("ngram", "draft_model")
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min / max when neither is given


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's `--speculative-config` keys that Tandem serves."""

    num_speculative_tokens: int
    method: str | None = None  # "ngram" or "draft_model" (inferred from `model`)
    model: str | None = None  # the draft model: a folder or hub id
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None  # no proposals while more requests run

    @property
    def kind(self) -> str:
        if self.method is not None:
            return self.method
        return "ngram" if self.model in (None, "ngram", "[ngram]") else "draft_model"

    @property
    def ngram_sizes(self) -> tuple[int, int]:
        """(min, max) of the n-grams an n-gram proposal matches, vLLM's defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return NGRAM_DEFAULT, NGRAM_DEFAULT
        return (low if low is not None else high), (high if high is not None else low)  # type: ignore[return-value]


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` that cannot be served; the message says why."""


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config JSON`, checked; raises SpeculativeConfigError."""
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
    except msgspec.DecodeError as exc:
        raise SpeculativeConfigError(
            f"--speculative-config: {exc} (Tandem serves vLLM's keys "
            f"{', '.join(SpeculativeConfig.__struct_fields__)})") from None
    if config.num_speculative_tokens < 1:
        raise SpeculativeConfigError("--speculative-config: num_speculative_tokens must be "
                                     "at least 1")
    if config.kind not in METHODS:
        raise SpeculativeConfigError(f"--speculative-config: method {config.kind!r}: Tandem "
                                     f"proposes by {' or '.join(METHODS)}")
    if config.kind == "draft_model" and not config.model:
        raise SpeculativeConfigError("--speculative-config: method draft_model needs 'model' "
                                     "(the draft model's folder or hub id)")
    low, high = config.ngram_sizes
    if config.kind == "ngram" and not 1 <= low <= high:
        raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min {low} must be "
                                     f"at least 1 and at most prompt_lookup_max {high}")
    if config.disable_by_batch_size is not None and config.disable_by_batch_size < 1:
        raise SpeculativeConfigError("--speculative-config: disable_by_batch_size must be at "
                                     "least 1")
    return config
