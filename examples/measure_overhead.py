"""Issue-2 measurement: per-round overhead of hf_retrace's candidate generator against transformers' native DFlash
generator on the same tiny weights, and total generate time with and without the drafter on a tiny model.

    python examples/measure_overhead.py        # CPU, 1 thread, median of 7 runs each
"""

import statistics
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_retrace
from hf_retrace import ReTraceConfig, ReTraceDrafter
from hf_retrace.bench.native import build_native_assistant, native_dflash_unavailable_reason

torch.set_num_threads(1)
torch.manual_seed(0)
target = Qwen3ForCausalLM(Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512)).eval()
drafter = ReTraceDrafter(ReTraceConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=8,
                                       mask_token_id=999, target_layer_ids=[0, 2], num_target_layers=4,
                                       retrace=False)).eval()
prompt = torch.randint(0, 999, (1, 12))
kwargs = dict(max_new_tokens=64, do_sample=False)


def timed(**extra):
    times = []
    for _ in range(7):
        start = time.perf_counter()
        out = target.generate(prompt, **kwargs, **extra)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


plain_s, plain_out = timed()
ours_s, ours_out = timed(assistant_model=drafter)
rounds = drafter.last_stats.rounds
assert torch.equal(ours_out, plain_out)
print(f"plain generate: {plain_s * 1e3:.1f} ms; with the hf_retrace drafter: {ours_s * 1e3:.1f} ms "
      f"({rounds} rounds, tau {drafter.last_stats.mean_acceptance_length:.2f}); identical: True")
reason = native_dflash_unavailable_reason(drafter.config)
if reason:
    print(f"native DFlash: unavailable ({reason})")
    sys.exit(0)
native = build_native_assistant(drafter)
native_s, native_out = timed(assistant_model=native, speculation_type="dflash")
print(f"native DFlash (same weights): {native_s * 1e3:.1f} ms; identical: {torch.equal(native_out, plain_out)}")
print(f"per-round time: hf_retrace {ours_s / rounds * 1e3:.2f} ms vs native {native_s / rounds * 1e3:.2f} ms "
      f"-> overhead {(ours_s - native_s) / rounds * 1e3:+.2f} ms per round")
