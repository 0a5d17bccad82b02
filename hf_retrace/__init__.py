"""hf_retrace: lossless speculative decoding for transformers with DFlash drafters and ReTrace.

    import hf_retrace
    drafter = hf_retrace.ReTraceDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
    out = target.generate(**inputs, assistant_model=drafter)
"""

from transformers import AutoConfig, AutoModel

from .configuration import ReTraceConfig
from .generation import attach, detach
from .generation.dispatch import install as _install_dispatch
from .modeling import ReTraceDrafter
from .retrace import RejectedSuffix
from .stats import GenerationStats

__version__ = "0.1.0"

AutoConfig.register(ReTraceConfig.model_type, ReTraceConfig, exist_ok=True)
AutoModel.register(ReTraceConfig, ReTraceDrafter, exist_ok=True)
GLOBAL_DISPATCH = _install_dispatch()

__all__ = ["GenerationStats", "ReTraceConfig", "ReTraceDrafter", "RejectedSuffix", "attach", "detach"]
