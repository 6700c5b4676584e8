"""The batch-client guide's async section (seed 003) with zml.AsyncClient."""

import asyncio

from zml import AsyncClient as LMClient


async def main() -> None:
    async with LMClient(model="meta-llama/llama-3-8b-instruct") as client:
        result = await client.agenerate("Hello")
        batch  = await client.agenerate_batch(["prompt A", "prompt B", "prompt C"])
        print(result.output_text)
        print([r.output_text for r in batch if r is not None])

asyncio.run(main())
