"""SWA location registry: which worker holds the sliding-window state for which prefix block."""
from services.swa_registry.core import RegistryLimits, RegistryStats, SwaRegistry

__all__ = ["RegistryLimits", "RegistryStats", "SwaRegistry"]
