"""Multi-LoRA: peft adapters on the base model, several in one batch (`adapters.py` reads
them, `slots.py` holds the active ones on the device and applies them, `manager.py` decides
which adapters hold the slots)."""
