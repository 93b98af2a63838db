"""Pins for starting and continuing a checkpointed run: the checkpoint package, frames, the runtime and where machines are found again.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""
