"""SDK 0.3 post (seed 001): the async client, and async streaming with infer_stream()."""

import asyncio
import zml

async def generate(prompt: str) -> str:
    async with zml.AsyncClient(api_key="...") as client:
        response = await client.infer(
            model="meta-llama/llama-3-8b-instruct",
            messages=[{"role": "user", "content": prompt}],
            policy="llama3-production"
        )
        return response.choices[0].message.content or ""

print(asyncio.run(generate("Explain tensor parallelism in two sentences")))


async def stream(prompt: str) -> None:
    async with zml.AsyncClient() as client:
        async for chunk in client.infer_stream(
            model="meta-llama/llama-3-8b-instruct",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
        ):
            print(chunk.text, end="", flush=True)
        print()

asyncio.run(stream("Write a haiku about GPUs"))
