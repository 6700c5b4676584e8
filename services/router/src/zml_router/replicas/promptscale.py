"""What the engines counted of each model's prompts, against the router's estimate from the
body's bytes: one process-wide record, fed by each reply (node.relay) and read by each request's
preparation (request.prepare), so it lives below both."""

from __future__ import annotations


class PromptScale:
    """Prompt tokens per body-size token, per model, learned from the engines' counts.

    The router sizes a prompt from its body (``prompt_tokens_from_body``: ~4 bytes a token);
    a tokenizer may count half as many again (llama's splits every digit: ~1,150 tokens in a
    2,900-byte body) or fewer, and every TTFT the router predicts and every prefill speed it
    learns in tokens inherits the error. Each reply's ``usage.prompt_tokens`` against the
    estimate it was routed on moves the model's factor a step (an EWMA, 0.2).

    >>> ps = PromptScale()
    >>> for _ in range(30):
    ...     ps.observe("m", ps.scaled("m", 700), 1100)
    >>> round(ps.get("m"), 2), ps.scaled("m", 700), ps.scaled("other", 700)
    (1.57, 1100, 700)
    """

    __slots__ = ("by_model",)
    STEP = 0.2
    #: Fewer estimated tokens than this say more about the envelope than the tokenizer.
    MIN_TOKENS = 64

    def __init__(self) -> None:
        self.by_model: dict[str, float] = {}

    def get(self, model: str) -> float:
        return self.by_model.get(model, 1.0)

    def scaled(self, model: str, estimate: int) -> int:
        f = self.by_model.get(model)
        return estimate if f is None else int(estimate * f + 0.5)

    def observe(self, model: str, routed_on: int, reported: int) -> None:
        """A reply counted ``reported`` prompt tokens for a request routed on ``routed_on``."""
        if routed_on < self.MIN_TOKENS or reported <= 0:
            return
        f = self.by_model.get(model, 1.0)
        f *= 1.0 + self.STEP * (min(4.0, max(0.25, reported / routed_on)) - 1.0)
        self.by_model[model] = min(4.0, max(0.25, f))


#: The router process's (zml_router.node.relay feeds it from each reply).
PROMPT_SCALE = PromptScale()
