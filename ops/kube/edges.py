"""The stack's service graph: which service opens a ZeroMQ link to which (the NetworkPolicies' edges).

Every link is a DEALER one service connects (`Service.link`, services/runtime/service.py) to another
service's inbox, its bind port; replies come back on that same connection, so an edge is needed in
one direction only: from the service that opens the link to the one it reaches. A service opens a
link to an address it was given, and the address reaches it in one of four ways; each rule below
is one of them, with the messages sent and the code that sends them:
1. its upstream (the topology's `upstream`): Register and Heartbeat (services/runtime/upstream.py)
   and its requests there;
2. a named peer (`kv_writer = "@kv_writer"` in its settings): PEER_TRAFFIC, by settings key;
3. a member registered with it, at the member's advertised address: MEMBER_CALLS, by member kind;
4. an address carried in a message (a request's return address, a reply-to, a worker a chunk or a
   table names): MESSAGE_ADDRESSED, by the kinds at both ends, and the SWA rules below.
The `/health` probes run inside each pod (127.0.0.1) and need no edge.
"""
from __future__ import annotations

from dataclasses import dataclass

from ops.topology import ServiceSpec, Topology

UPSTREAM_TRAFFIC = "Register, Heartbeat (services/runtime/upstream.py) and its requests to its upstream"

# settings key of a named peer -> what is sent to it
PEER_TRAFFIC = {
    "kv_writer": "KvWritePages of finished blocks (services/workers/persist.py); KvReadPages when it has no "
                 "kv_store_dir to read (services/workers/prefix_load.py)",
    "swa_registry": "SwaRegister of the window states it holds (services/workers/persist.py); SwaFetch "
                    "(services/workers/prefix_load.py)",
    "decode_router": "DecodeTableQuery (services/prefill_router/service.py)",
}

# (upstream kind, member kind) -> what the upstream sends a registered member at its advertised address
MEMBER_CALLS = {
    ("prefill_router", "prefill_worker"): "PrefillWork, and AbortRequest forwarded (services/prefill_router/service.py)",
    ("gateway", "grammar_compiler"): "GrammarCompile while the request is routed (services/gateway/http_app.py)",
    ("vision_balancer", "vision_worker"): "VisionEncode, VisionCancel (services/vision_balancer/service.py)",
}

STREAMING_KINDS = ("prefill_worker", "decode_worker", "unified_worker")   # GenerateChunk.worker names them
FETCHING_KINDS = ("prefill_worker", "unified_worker")   # fetch a grammar, images' embeddings from others

# (kinds that open the link, kinds they reach, what is sent and where): the address travels in messages
MESSAGE_ADDRESSED = (
    (("decode_worker", "unified_worker"), ("gateway",),
     "GenerateChunk to the request's return address, StatusQuery watching the gateways it streams to "
     "(services/workers/streaming.py)"),
    (("prefill_worker",), ("gateway",),
     "GenerateChunk to the request's return address when the first token ends the request "
     "(services/workers/prefill.py)"),
    (("gateway",), STREAMING_KINDS,
     "AbortRequest to the worker a GenerateChunk named (services/gateway/service.py), StatusQuery "
     "watching it (services/gateway/worker_watch.py)"),
    (("prefill_worker",), ("decode_worker",),
     "StateHandoff, AbortRequest and StatusQuery during the hand-off to the decode worker the decode "
     "router's table names (services/workers/prefill.py)"),
    (FETCHING_KINDS, ("grammar_compiler",),
     "GrammarCompile to the compiler the gateway named (services/workers/grammar.py)"),
    (FETCHING_KINDS, ("vision_balancer",),
     "VisionEncode, VisionCancel to a vision group leader the gateway named (services/workers/vision_client.py)"),
    (("vision_balancer",), FETCHING_KINDS,
     "VisionFailed to the requesting worker (services/vision_balancer/service.py)"),
    (("vision_worker",), FETCHING_KINDS,
     "VisionEncoded / VisionFailed and the embeddings, straight to the requesting worker "
     "(services/vision_worker/service.py)"),
)
# The SWA registry forwards a SwaFetch to the worker holding the window state (a service that
# registers with it: names it as its swa_registry peer), and the holder answers the fetching worker.
SWA_FORWARD = "SwaFetch forwarded to the holder of the window state (services/swa_registry/service.py)"
SWA_ANSWER = ("SwaState, the answer to a SwaFetch the registry forwarded here, straight to the fetching "
              "prefill worker (services/workers/engine_worker.py)")
SWA_FETCHING_KINDS = ("prefill_worker",)   # services/workers/prefix_load.py


@dataclass(frozen=True, slots=True)
class Edge:
    client: str   # the service that opens the link (topology name)
    server: str   # the service whose inbox it reaches
    why: str


def service_edges(topology: Topology) -> list[Edge]:
    """Every edge of the topology's graph, one per (client, server) with the reasons joined, sorted."""
    found: dict[tuple[str, str], list[str]] = {}

    def add(client: ServiceSpec, server: ServiceSpec, why: str) -> None:
        reasons = found.setdefault((client.name, server.name), [])
        if why not in reasons:
            reasons.append(why)

    by_kind = _by_kind(topology)
    for spec in topology.services:
        if spec.upstream:
            upstream = topology.spec(spec.upstream)
            add(spec, upstream, UPSTREAM_TRAFFIC)
            if (upstream.kind, spec.kind) in MEMBER_CALLS:
                add(upstream, spec, MEMBER_CALLS[upstream.kind, spec.kind])
        for key, peer in spec.peers.items():
            add(spec, topology.spec(peer), f"settings.{key}: " + PEER_TRAFFIC.get(key, f"its {key} peer"))
    for client_kinds, server_kinds, why in MESSAGE_ADDRESSED:
        for client in _of_kinds(by_kind, client_kinds):
            for server in _of_kinds(by_kind, server_kinds):
                add(client, server, why)
    for registry, holders in _swa_holders(topology).items():
        for holder in holders:
            add(topology.spec(registry), holder, SWA_FORWARD)
            for fetcher in holders:
                if fetcher.kind in SWA_FETCHING_KINDS:
                    add(holder, fetcher, SWA_ANSWER)
    return [Edge(client, server, "; ".join(reasons)) for (client, server), reasons in sorted(found.items())]


def _by_kind(topology: Topology) -> dict[str, list[ServiceSpec]]:
    kinds: dict[str, list[ServiceSpec]] = {}
    for spec in topology.services:
        kinds.setdefault(spec.kind, []).append(spec)
    return kinds


def _of_kinds(by_kind: dict[str, list[ServiceSpec]], kinds: tuple[str, ...]) -> list[ServiceSpec]:
    return [spec for kind in kinds for spec in by_kind.get(kind, [])]


def _swa_holders(topology: Topology) -> dict[str, list[ServiceSpec]]:
    """SWA registry service name -> the services that name it as their swa_registry peer."""
    holders: dict[str, list[ServiceSpec]] = {}
    for spec in topology.services:
        registry = spec.peers.get("swa_registry")
        if registry:
            holders.setdefault(registry, []).append(spec)
    return holders
