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

# kind -> the dataclass its settings are parsed into (services/runtime/settings.py), each in a module
# light enough for `epd up` to check every service's settings before it starts one
SETTINGS: dict[str, str] = {
    "swa_registry": "services.swa_registry.service:SwaRegistrySettings",
    "kv_writer": "services.kv_writer.service:KvWriterSettings",
    "grammar_compiler": "services.grammar_compiler.service:GrammarCompilerSettings",
    "vision_balancer": "services.vision_balancer.service:VisionBalancerSettings",
    "vision_worker": "services.vision_worker.settings:VisionWorkerSettings",
    "gateway": "services.gateway.service:GatewaySettings",
    "unified_worker": "services.workers.settings:WorkerSettings",
    "prefill_worker": "services.workers.settings:WorkerSettings",
    "decode_worker": "services.workers.settings:WorkerSettings",
    "prefill_router": "services.prefill_router.settings:PrefillRouterSettings",
    "decode_router": "services.decode_router.service:DecodeRouterSettings",
}


def settings_class(kind: str) -> type | None:
    """The settings dataclass of a catalog kind; None for "echo" (the diagnostic service reads none) and for a
    "module:Class" kind, which checks its own settings when it starts."""
    target = SETTINGS.get(kind)
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve(kind: str) -> type[Service]:
    target = KINDS.get(kind, kind)
    if ":" not in target:
        raise ValueError(f"unknown service kind {kind!r}; known: {', '.join(sorted(KINDS))}, or module:Class")
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise ValueError(f"{target} is not a Service subclass")
    return cls
