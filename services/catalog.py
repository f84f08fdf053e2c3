"""Service kinds by name. Imported lazily so a router never imports torch.

A kind may also be given as "package.module:Class" to run any Service subclass (how a user swaps
in their own implementation, and how tests run their helper services).
"""
from __future__ import annotations

import importlib

from services.runtime.service import Service

KINDS: dict[str, str] = {
    "echo": "services.runtime.service:Service",
    "swa_registry": "services.swa_registry.service:SwaRegistryService",
    "kv_writer": "services.kv_writer.service:KvWriterService",
    "grammar_compiler": "services.grammar_compiler.service:GrammarCompilerService",
    "vision_balancer": "services.vision_balancer.service:VisionBalancerService",
    "vision_worker": "services.vision_worker.service:VisionWorkerService",
    "gateway": "services.gateway.service:GatewayService",
    "unified_worker": "services.workers.unified:UnifiedWorker",
    "prefill_worker": "services.workers.prefill:PrefillWorker",
    "decode_worker": "services.workers.decode:DecodeWorker",
    "prefill_router": "services.prefill_router.service:PrefillRouterService",
    "decode_router": "services.decode_router.service:DecodeRouterService",
}


def resolve(kind: str) -> type[Service]:
    target = KINDS.get(kind, kind)
    if ":" not in target:
        raise ValueError(f"unknown service kind {kind!r}; known: {', '.join(sorted(KINDS))}, or module:Class")
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise ValueError(f"{target} is not a Service subclass")
    return cls
