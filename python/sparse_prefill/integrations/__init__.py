"""Engine adapters: transformers (`integrations.transformers.register()`), vLLM (`integrations.vllm.register`, the
`vllm.general_plugins` entry point) and SGLang (`integrations.sglang.register`, the `sglang.srt.plugins` entry point).

None of the engines is imported here; torch is imported by `core` (the adapters need it). See docs/integrations.md.
"""

from .core import SparsePrefillConfig, VarlenDispatch, library_selection_defaults
from .mean_cache import MeanCacheTracker

__all__ = ["SparsePrefillConfig", "VarlenDispatch", "MeanCacheTracker", "library_selection_defaults"]
