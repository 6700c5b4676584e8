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
    estimate it was routed on moves the model's factor a step (an EWMA, 0.2; within 2%, none).

    >>> ps = PromptScale()
    >>> for _ in range(30):
    ...     ps.observe("m", ps.scaled("m", 700), 1100)
    >>> abs(ps.scaled("m", 700) / 1100 - 1) < 0.02, ps.scaled("other", 700)
    (True, 700)
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
        if routed_on < 64 or reported <= 0:  # MIN_TOKENS
            return
        r = reported / routed_on
        if 0.98 < r < 1.02:
            return  # settled: nothing to write (this runs on every reply)
        f = self.by_model.get(model, 1.0) * (1.0 + 0.2 * ((4.0 if r > 4.0 else r) - 1.0))  # STEP
        self.by_model[model] = 4.0 if f > 4.0 else 0.25 if f < 0.25 else f


#: The router process's (zml_router.node.relay feeds it from each reply).
PROMPT_SCALE = PromptScale()
