"""The Batch API's shared parts: what the gateway's /v1/files and /v1/batches handlers and the
batch runners both need (docs/batches.md).

- :mod:`~zmlcore.batch.lines`: checking an input file line by line as it arrives (pure);
- :mod:`~zmlcore.batch.ids`: file, batch and owner identifiers (pure);
- :mod:`~zmlcore.batch.objects`: the OpenAI JSON clients read, made from stored records (pure);
- :mod:`~zmlcore.batch.shards`: cutting a file into units of work (pure);
- :mod:`~zmlcore.batch.store`: the JetStream buckets and streams behind it all (I/O).
"""
