"""The engines a simulated node imitates, one module each: the HTTP details that differ between
vLLM, TGI, SGLang, llama.cpp and a plain OpenAI-compatible server (error bodies, overload and
loading answers, extra discovery and admin routes, when the port starts listening).

:mod:`zml_sim.server` is the shared part (OpenAI API, health, metrics, /sim admin) and asks
``node.face`` for everything engine-shaped. Metric names live in :mod:`zml_sim.metrics`.
"""

from __future__ import annotations

from zml_sim.faces import llamacpp
from zml_sim.faces import openai
from zml_sim.faces import sglang
from zml_sim.faces import tgi
from zml_sim.faces import vllm
from zml_sim.faces.base import Face

#: Engine name -> its face, in the order the CLI lists them.
FACES: dict[str, Face] = {f.name: f for f in (vllm.FACE, tgi.FACE, sglang.FACE, llamacpp.FACE, openai.FACE)}
ENGINES = tuple(FACES)

__all__ = ["ENGINES", "FACES", "Face"]
