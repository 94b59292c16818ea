"""The one-command device check (`make gpu-check`, docs/gpu.md) and its CPU dry run."""
