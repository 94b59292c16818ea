"""Sampling: a step's tokens and logprobs from the model's last hidden states, on the LM head's
scan (`Sampler`, its constrained rows in `ConstrainedSampler`) or whole on the device
(`DeviceSampler`, with `SamplingBatch`'s host-side arguments), and prompt logprobs scored chunk by
chunk (`PromptLogprobsAccumulator`). Imports `layers/`, `structured/` and `sched/`."""
