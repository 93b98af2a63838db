"""A priced, scripted model behind the fake server."""

from __future__ import annotations

from support.fakeserver import answer

PRICE_IN, PRICE_OUT = 3.0, 15.0  # USD per million tokens


class Model:
    """A scripted model behind the fake server: judge calls and produce calls get their own answers.

    Token counts differ per call so that wrong sums cannot pass by accident.
    """

    def __init__(self, verdicts=("2", '{"choice": 1}')):
        self.verdicts = list(verdicts)
        self.served: list[tuple[int, int]] = []

    def __call__(self, request):
        number = len(self.served) + 1
        tokens = (100 * number + 7, 10 * number + 3)
        self.served.append(tokens)
        if "none of the above" in request.user:
            text = self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]
            return answer(text, input_tokens=tokens[0], output_tokens=tokens[1])
        if request.user.startswith("Summarize"):
            return answer("A short summary.", input_tokens=tokens[0], output_tokens=tokens[1])
        return answer(
            f"Draft number {number}.",
            reasoning="I considered the topic.",
            input_tokens=tokens[0],
            output_tokens=tokens[1],
        )

    def cost(self) -> float:
        return sum((i * PRICE_IN + o * PRICE_OUT) / 1e6 for i, o in self.served)
