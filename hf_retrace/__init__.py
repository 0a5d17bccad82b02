"""hf_retrace: lossless speculative decoding for transformers with DFlash drafters and ReTrace.

    import hf_retrace
    drafter = hf_retrace.ReTraceDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
    out = target.generate(**inputs, assistant_model=drafter)
"""

from transformers import AutoConfig, AutoModel

from .configuration import ReTraceConfig
from .generation import attach, detach
from .generation.dispatch import install as _install_dispatch
from .generation.policy import RoundPolicy, set_call_observer, set_policy_resolver
from .modeling import ReTraceDrafter
from .retrace import RejectedSuffix
from .stats import GenerationStats
from .tuning.auto import auto_policy, note_realized

__version__ = "0.1.0"

AutoConfig.register(ReTraceConfig.model_type, ReTraceConfig, exist_ok=True)
AutoModel.register(ReTraceConfig, ReTraceDrafter, exist_ok=True)
GLOBAL_DISPATCH = _install_dispatch()
set_policy_resolver(auto_policy)  # a call without its own policy gets the one tuned for this machine
set_call_observer(note_realized)  # the tuned prediction is checked against the first real calls

__all__ = ["GenerationStats", "ReTraceConfig", "ReTraceDrafter", "RejectedSuffix", "RoundPolicy", "attach", "detach"]
