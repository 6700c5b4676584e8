"""``zml node-agent``: the node probe (``GET /zml/v1/node``) served beside a real engine.

Real engines do not report their hardware, so the health service cannot validate a node's
declared accelerator type and driver from them. The agent reads the vendor tools that are
present (nvidia-smi, amd-smi / rocm-smi, hl-smi, neuron-ls), maps the product to a ZML type ID
and answers one JSON document. Parsers are pure (:mod:`zml_nodeagent.smi`), tested against
recorded outputs.

Example::

    zml node-agent --port 9400 --engine-url http://127.0.0.1:8000
    curl http://127.0.0.1:9400/zml/v1/node
"""

from zml_nodeagent.smi import Hardware
from zml_nodeagent.smi import detect

__all__ = ["Hardware", "detect"]
