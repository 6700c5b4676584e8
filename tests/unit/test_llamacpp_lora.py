"""llama.cpp LoRA adapters (issue 32): what health reads from ``GET /lora-adapters``, what a
router sends a llama-server for an adapter and for its base, and how the planner treats
adapters a llama-server holds from start and cannot change. Pure, plus the probe over httpx's
mock transport (as tests/unit/test_health_adapters.py)."""

from __future__ import annotations

import doctest
import json

import httpx
import msgspec

from zmlcore.config import AdapterConfig, parse_config
from zmlcore.messages import NodeState
from zmlcore.placement import AdapterDemand, ModelDemand, NodeOffer, PlanParams, plan
from zmlcore.placement.adapters import place_adapters
from zml_health import served
from zml_health.adapters import llamacpp
from zml_router.answer import continuation
from zml_router.answer.continuation import Sent
from zml_router.node import lora
from zml_router.node.attempt import NodeBodies
from zml_warmup import placer

P0 = PlanParams(move_cost_per_h=0.0)


def test_doctests() -> None:
    for mod in (llamacpp, served, lora):
        assert doctest.testmod(mod).failed == 0, mod.__name__


# --- health: GET /lora-adapters ----------------------------------------------------------------
# As llama-server (build 11434) answers it for `--lora a.gguf --lora /abs/b.gguf`.
LISTED = [{"id": 0, "path": "a.gguf", "scale": 1.0, "task_name": "", "prompt_prefix": ""},
          {"id": 1, "path": "/abs/b.gguf", "scale": 0.0, "task_name": "", "prompt_prefix": ""}]


def client(status: int, body: object) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/lora-adapters" and request.method == "GET"
        return httpx.Response(status, content=json.dumps(body).encode())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_read_loras_lists_each_file_with_its_id() -> None:
    async with client(200, LISTED) as c:
        got = await llamacpp.read_loras(c, "http://n", 1.0)
    assert got == [llamacpp.Lora(0, "a.gguf", 1.0), llamacpp.Lora(1, "/abs/b.gguf", 0.0)]


async def test_read_loras_none_means_ask_again_and_404_means_none() -> None:
    async with client(503, {"error": "loading"}) as c:
        assert await llamacpp.read_loras(c, "http://n", 1.0) is None
    async with client(404, {"error": "not found"}) as c:
        assert await llamacpp.read_loras(c, "http://n", 1.0) == []

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as c:
        assert await llamacpp.read_loras(c, "http://n", 1.0) is None


def test_adapters_match_by_path_then_file_name_on_served_bases_only() -> None:
    ads = {"x-a": AdapterConfig(base="x", path="a.gguf"),
           "x-b": AdapterConfig(base="x", path="/elsewhere/b.gguf"),
           "y-c": AdapterConfig(base="y", path="a.gguf"),      # its base is not on the node
           "x-d": AdapterConfig(base="x", path="/d.gguf")}     # no such file
    assert served.match_loras([(0, "a.gguf"), (1, "/abs/b.gguf")], ads, ["x"]) == {"x-a": 0, "x-b": 1}
    # an exact path wins over a file name
    ads2 = {"e": AdapterConfig(base="x", path="/abs/b.gguf")}
    assert served.match_loras([(0, "/tmp/b.gguf"), (1, "/abs/b.gguf")], ads2, ["x"]) == {"e": 1}


# --- router: the body a llama-server gets -------------------------------------------------------
def node(**kw: object) -> NodeState:
    return NodeState(node_id="n", accelerator_type="cpu", family="cpu", endpoint="http://n", backend="llamacpp",
                     **kw)  # type: ignore[arg-type]


def test_an_adapter_goes_as_its_base_with_its_id_and_the_base_with_every_adapter_off() -> None:
    st = node(models=["tiny", "tiny-pirate"], served_names={"tiny": "tiny.gguf"}, lora_ids={"tiny-pirate": 2},
              lora_count=3)
    assert lora.for_node(st, "tiny-pirate", "tiny") == ("tiny.gguf", ((2, 1.0),))
    assert lora.for_node(st, "tiny", None) == ("tiny.gguf", ((0, 0.0),))
    # a node with no --lora files: nothing added, as before
    assert lora.for_node(node(models=["tiny"]), "tiny", None) == ("tiny", None)


def test_node_bodies_carry_each_nodes_lora_list() -> None:
    raw = json.dumps({"model": "tiny-pirate", "messages": [{"role": "user", "content": "hi"}]}).encode()
    bodies = NodeBodies(raw, "tiny-pirate", clean=True)
    a = json.loads(bodies("tiny.gguf", ((2, 1.0),)))
    assert a["model"] == "tiny.gguf" and a["lora"] == [{"id": 2, "scale": 1.0}]
    # another node's body (no --lora files) carries no ids of the first one
    b = json.loads(bodies("tiny-pirate"))
    assert "lora" not in b and b["model"] == "tiny-pirate"
    assert json.loads(bodies("tiny.gguf", ((0, 0.0),)))["lora"] == [{"id": 0, "scale": 0.0}]


def test_a_continuation_on_a_llamacpp_node_keeps_the_adapter() -> None:
    raw = json.dumps({"model": "tiny-pirate", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 10}).encode()
    sent = Sent(text="Arr", tokens=1, finished=False)
    out = json.loads(continuation.body(raw, clean=True, kind="chat", sent=sent, backend="llamacpp",
                                       name="tiny.gguf", lora=((1, 1.0),)))
    assert out["lora"] == [{"id": 1, "scale": 1.0}] and out["model"] == "tiny.gguf"


# --- health -> router: a NodeState survives the wire with its ids -------------------------------
def test_node_state_carries_lora_ids_over_the_wire() -> None:
    st = node(lora_ids={"a": 0}, lora_count=1)
    back = msgspec.json.decode(msgspec.json.encode(st), type=NodeState)
    assert back.lora_ids == {"a": 0} and back.lora_count == 1


# --- the planner: adapters a llama-server holds for good ----------------------------------------
def test_the_plan_keeps_the_base_where_a_fixed_adapter_is_when_nothing_else_can_load_it() -> None:
    # "dear" was started with --lora pirate; "cheap" without. Without the adapter's demand the
    # cheap node alone would do; with it, the base must stay on the node that has the adapter.
    offers = [NodeOffer("dear", "X", 4.0, {"m": 10.0}, adapter_slots=1, models=frozenset({"m"}),
                        adapters=frozenset({"pirate"}), adapters_fixed=True),
              NodeOffer("cheap", "Y", 1.0, {"m": 10.0}, models=frozenset())]
    no_adapter = plan(offers, [ModelDemand("m", 2.0)], [AdapterDemand("pirate", "m", 0.0)], params=P0)
    assert no_adapter.nodes_of("m") == ["cheap"]
    p = plan(offers, [ModelDemand("m", 2.0)], [AdapterDemand("pirate", "m", 1.0)], params=P0)
    assert "dear" in p.nodes_of("m") and p.adapters["dear"] == {"pirate"}
    assert p.adapters["cheap"] == frozenset() and "pirate" not in p.unserved


def test_a_fixed_adapters_demand_beyond_its_nodes_is_unserved_not_moved() -> None:
    offers = [NodeOffer("lora", "X", 1.0, {"m": 1.0}, adapter_slots=1, adapters=frozenset({"a"}),
                      adapters_fixed=True),
              NodeOffer("other", "X", 1.0, {"m": 10.0})]
    p = plan(offers, [ModelDemand("m", 0.0)], [AdapterDemand("a", "m", 3.0)], params=P0)
    assert p.adapters["lora"] == {"a"} and p.adapters["other"] == frozenset()
    assert abs(p.unserved["a"] - 2.0) < 1e-6


def test_fixed_nodes_get_no_other_adapter_and_count_toward_a_hot_ones_share() -> None:
    offers = [NodeOffer("l0", "X", 1.0, {"m": 2.0}, adapter_slots=1, adapters=frozenset({"hot"}),
                        adapters_fixed=True),
              *(NodeOffer(f"v{i}", "X", 1.0, {"m": 2.0}, adapter_slots=2) for i in range(3))]
    placed = {"l0": frozenset({"m"}), **{f"v{i}": frozenset({"m"}) for i in range(3)}}
    ads = [AdapterDemand("hot", "m", 3.0), AdapterDemand("warm", "m", 1.0)]
    got = place_adapters(offers, placed, ads)
    assert got["l0"] == {"hot"}  # never "warm": llama-server cannot load it
    # l0's copy counts: hot's first copy is there, and the run-time nodes' free slots take
    # both adapters (the most requests per copy first)
    assert all(got[f"v{i}"] == {"hot", "warm"} for i in range(3))
    one_slot = [offers[0], *(NodeOffer(f"v{i}", "X", 1.0, {"m": 2.0}, adapter_slots=1) for i in range(3))]
    got1 = place_adapters(one_slot, placed, ads)
    assert got1["l0"] == {"hot"} and sorted(a for n in ("v0", "v1", "v2") for a in got1[n]) == ["hot", "hot", "warm"]
    # its base leaving the node leaves the adapter with it
    got = place_adapters(offers, {**placed, "l0": frozenset()}, ads)
    assert got["l0"] == frozenset()


CFG = parse_config({
    "nodes": [
        {"id": "llama", "accelerator": "cpu", "endpoint": "http://a", "backend": "llamacpp", "models": ["m"],
         "adapter_slots": 4},
        {"id": "vllm", "accelerator": "cpu", "endpoint": "http://b", "backend": "vllm", "models": ["m"],
         "adapter_slots": 2},
    ],
    "adapters": {"t": {"base": "m", "path": "/t"}, "u": {"base": "m", "path": "/u.gguf"}},
})


def test_warmup_loads_an_adapter_on_demand_only_where_the_engine_can() -> None:
    states = {"llama": NodeState(node_id="llama", accelerator_type="cpu", family="cpu", endpoint="http://a",
                                 backend="llamacpp", status="up", models=["m", "u"], adapters=["u"],
                                 lora_ids={"u": 0}, lora_count=1),
              "vllm": NodeState(node_id="vllm", accelerator_type="cpu", family="cpu", endpoint="http://b",
                                backend="vllm", status="up", models=["m"], queue_waiting=50)}
    # the llama.cpp node has room by its adapter_slots and a shorter queue, but cannot load "t"
    assert placer.adapter_home(CFG, states, "t") == "vllm"
    now = placer.holding(states, CFG)
    assert now["llama"].adapter_slots == 1 and now["vllm"].adapter_slots == 2
    assert placer.holding({"vllm": states["vllm"]}, CFG)["vllm"].adapters == frozenset()


def test_router_mode_adapters_come_with_their_model_and_the_plan_loads_it_for_them() -> None:
    """llama-server's router mode holds one model at a time here (--models-max 1), model "a"
    loaded; its --models-preset gives "b" the adapter "parrot". Demand is all for parrot: the
    plan puts "b" on the node (parrot comes with it, no adapter move of its own) and takes "a"
    off, where before only loaded models' adapters were seen and parrot was left unserved."""
    from zmlcore.placement.moves import all_steps

    cfg = parse_config({
        "nodes": [{"id": "router", "accelerator": "cpu", "endpoint": "http://a", "backend": "llamacpp",
                   "models": ["a", "b"]}],
        "adapters": {"parrot": {"base": "b", "path": "/l/parrot.gguf"}, "pirate": {"base": "a", "path": "/l/p.gguf"}},
        "planner": {"mode": "apply", "move_cost_per_h": 0.01}})
    st = NodeState(node_id="router", accelerator_type="cpu", family="cpu", endpoint="http://a", backend="llamacpp",
                   status="up", models=["a", "pirate"], adapters=["pirate"], lora_ids={"pirate": 0}, lora_count=1,
                   model_adapters={"a": ["pirate"], "b": ["parrot"]}, prefill_tps=1000, decode_tps=50,
                   max_concurrency=4, cost_per_hour=0.2)
    from zml_warmup.demand import DemandWindow

    d = DemandWindow(60.0, 0.0)
    for i in range(60):
        d.record("parrot", float(i), 100, 10)
    inputs = placer.gather(cfg, {"router": st}, {"router": ("a", "b")}, d, 60.0)
    offer = inputs.offers[0]
    assert offer.adapters == {"pirate", "parrot"} and offer.adapters_fixed
    p = placer.make_plan(cfg, inputs)
    assert p.nodes_of("b") == ["router"] and p.nodes_of("a") == [] and "parrot" not in p.unserved
    assert p.adapters["router"] == {"parrot"}
    now = placer.holding({"router": st}, cfg)
    assert now["router"].adapters == {"pirate"}
    steps = all_steps(now, p.models, p.adapters)
    assert sorted((s.kind, s.name) for s in steps) == [("load", "b"), ("unload", "a")], steps
