"""The device check's anchor loop (tests/device/graph_loop.py) on the CPU: its graph stand-in
replays what the eager loop computes, and a loop that is wrong only under capture fails the
check here rather than on the GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.device import graph_loop
from tests.device.graph_loop import StaticLoop, TraceGraph, replay_check, replays_eager, timed_loop

BATCH, LENGTH, STEPS = 3, 12, 10


@pytest.fixture(scope="module")
def model() -> Any:
    """A small Llama whose tokens depend on its positions and its cache (weights drawn wide,
    as the dry run's model's are): a loop that gets either wrong gives other tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.25)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts(model: Any) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(10, model.config.vocab_size, (BATCH, LENGTH),
                         generator=generator).tolist()


def test_the_replayed_loop_gives_the_eager_tokens(model: Any, prompts: list[list[int]]) -> None:
    _, eager = timed_loop(model, prompts, STEPS, graphs=False)
    _, replayed = timed_loop(model, prompts, STEPS, graphs=True)
    assert torch.equal(eager, replayed)
    assert len(set(eager.flatten().tolist())) > STEPS  # tokens that depend on the state


def test_the_step_by_step_check_agrees_exactly(model: Any, prompts: list[list[int]]) -> None:
    check = replay_check(model, prompts, STEPS)
    assert check["free_running_agreement"] == 1.0 and check["lockstep_agreement"] == 1.0
    assert check["max_rel_logit_error"] == 0.0 and not check["disagreements"]
    assert check["graph"] == "trace stand-in" and replays_eager(check, check)


class PythonCounterLoop(StaticLoop):
    """Positions from a Python int: right eagerly, a constant once captured."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.next_position = self.ids.shape[1]

    def step(self) -> torch.Tensor:
        self.positions.fill_(self.next_position)
        self.next_position += 1
        return super().step()


class RebindingLoop(StaticLoop):
    """The sampled token bound to a new tensor instead of copied into the static input: the
    eager loop reads it, the graph keeps reading the old one."""

    def step(self) -> torch.Tensor:
        logits = self.model(input_ids=self.token, position_ids=self.positions, use_cache=True,
                            **self.cache_arg).logits[:, -1]
        self.token = logits.argmax(-1, keepdim=True)
        self.positions.add_(1)
        return logits


def unrestored_capture(loop: StaticLoop) -> Any:
    """The capture's warm-ups left in the state: the replays start two tokens late."""
    return TraceGraph(loop.step)


@pytest.mark.parametrize("mistake", ["python_counter", "rebinding", "unrestored"])
def test_a_loop_wrong_under_capture_fails_the_check(model: Any, prompts: list[list[int]],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    mistake: str) -> None:
    if mistake == "unrestored":
        monkeypatch.setattr(graph_loop, "capture", unrestored_capture)
    else:
        loop = PythonCounterLoop if mistake == "python_counter" else RebindingLoop
        monkeypatch.setattr(graph_loop, "StaticLoop", loop)
    check = replay_check(model, prompts, STEPS)
    assert check["free_running_agreement"] < 0.9, check
    assert not replays_eager(check, check)


def test_a_step_that_reads_the_device_cannot_be_captured() -> None:
    weight = torch.ones(4)

    def syncing_step() -> torch.Tensor:
        return weight * float(weight.sum())

    with pytest.raises(RuntimeError, match="cannot be captured"):
        TraceGraph(syncing_step)
