"""hf_retrace: lossless speculative decoding for transformers with DFlash drafters and ReTrace.

    import hf_retrace
    drafter = hf_retrace.ReTraceDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
    out = target.generate(**inputs, assistant_model=drafter)
"""

from typing import Any

from transformers import AutoConfig, AutoModel

from .configuration import ReTraceConfig
from .generation import detach
from .generation.dispatch import attach as _attach
from .generation.dispatch import install as _install_dispatch
from .generation.policy import RoundPolicy
from .modeling import ReTraceDrafter
from .retrace import RejectedSuffix
from .stats import GenerationStats
from .tuning.auto import auto_policy
from .tuning.realized import note_realized

__version__ = "0.1.0"

AutoConfig.register(ReTraceConfig.model_type, ReTraceConfig, exist_ok=True)
AutoModel.register(ReTraceConfig, ReTraceDrafter, exist_ok=True)
# a call without its own policy gets the one tuned for this machine; the prediction is checked against real calls
GLOBAL_DISPATCH = _install_dispatch(resolver=auto_policy, observer=note_realized)


def attach(model: Any) -> Any:
    """The opt-in, per-model dispatch (with ``HF_RETRACE_NO_GLOBAL_PATCH=1``): only ``model`` dispatches hf_retrace
    drafters, with the policies tuned for this machine. Returns ``model``.

    Example: ``target = hf_retrace.attach(target); target.generate(**inputs, assistant_model=drafter)``.
    """
    return _attach(model, resolver=auto_policy, observer=note_realized)


__all__ = ["GenerationStats", "ReTraceConfig", "ReTraceDrafter", "RejectedSuffix", "RoundPolicy", "attach", "detach"]
