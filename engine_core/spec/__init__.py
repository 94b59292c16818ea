"""Speculative decoding's proposals: what a request's next tokens may be, for the target model
to verify in one forward (engine_core/sample/speculative.py accepts them)."""
