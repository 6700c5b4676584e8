"""The batch-client guide (seed 003) with ZML: callbacks to disk, rate limits, structured output,
retries, timeouts and default request arguments.

`from infermesh import LMClient` becomes `from zml import Client as LMClient
from zml import InferResult`; model names are
ZML's; `save` got type annotations so that mypy --strict passes. Embeddings, transcription and client-side `deployments` have no ZML equivalent: ZML
routes across nodes on the server side (see result.routing).
"""

import json

from pydantic import BaseModel

from zml import Client as LMClient
from zml import InferResult

prompts = [f"Write one sentence about accelerator number {i}." for i in range(20)]

with open("results.jsonl", "w") as out, \
     LMClient(model="meta-llama/llama-3-8b-instruct", max_parallel_requests=32) as client:

    def save(index: int, result: InferResult | None, error: BaseException | None) -> None:
        row: dict[str, object] = {"index": index}
        if error is not None:
            row["error"] = str(error)
        else:
            assert result is not None
            row["output_text"] = result.output_text
        out.write(json.dumps(row) + "\n")
        out.flush()

    client.generate_batch(prompts, on_result=save)

client = LMClient(
    model="meta-llama/llama-3-8b-instruct",
    rpm=500,      # requests per minute
    tpm=100_000,  # tokens per minute
)
print(client.generate("Hello").output_text)


class Answer(BaseModel):
    value: int
    confidence: float

result = client.generate(
    "What is 2 + 2? Respond in JSON.",
    response_format=Answer,
)

print(result.output_text)   # raw JSON string
print(result.output_parsed) # Answer(value=4, confidence=0.99), or None if the model did not answer JSON

client = LMClient(
    model="meta-llama/llama-3-8b-instruct",
    max_retries=3,   # default; set to 0 to disable
)
result = client.generate("Hello")
print(result.metrics.retries)   # 0 on first-attempt success

client = LMClient(
    model="meta-llama/llama-3-8b-instruct",
    timeout=30.0,   # seconds
)
result = client.generate("Hello", timeout=5.0, max_tokens=64)

client = LMClient(
    model="meta-llama/llama-3-8b-instruct",
    default_request_kwargs={"max_tokens": 256, "temperature": 0.7},
)
print(client.generate("Hello").usage)
