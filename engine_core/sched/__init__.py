"""Scheduling and the KV cache's bookkeeping: which requests run in a step and how many of their
tokens (`Scheduler`), the paged blocks and their prefix cache (`BlockManager`), a request's state
(`Request`) and when a sampled token ends it (`StopRules`). Imports `sample/` (a request's
`RequestSampling`) and `structured/`."""
