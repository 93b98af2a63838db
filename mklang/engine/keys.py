"""Idempotency keys of model and tool calls, stable across a crash and a resume."""


class Calls:
    """Hands out idempotency keys for the model and tool calls of one step branch."""

    __slots__ = ("count", "prefix")

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.count = 0

    def next(self) -> str:
        self.count += 1
        return f"{self.prefix}.{self.count}"
