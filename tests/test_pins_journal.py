"""Pins for the run journal, checkpoint signatures and old-format checkpoints.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""
