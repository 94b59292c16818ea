"""Sampling: a step's tokens and logprobs from the model's last hidden states. One input, the
step's `SamplingBatch` (built by `build_sampling_batch`), and one interface, `TokenSampler`,
which two implement: on the LM head's scan (`Sampler`, its constrained rows in
`ConstrainedSampler`) and whole on the device (`DeviceSampler`), with the same ops
(`logits_ops`). Prompt logprobs are scored chunk by chunk (`PromptLogprobsAccumulator`).
Imports `layers/` and `structured/`, never the scheduler."""
