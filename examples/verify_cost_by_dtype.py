"""What verifying k drafts costs on this machine, by dtype: the target forward over k + 1 new tokens on a cached
context, in units of a one-token step of the same dtype, plus one linear layer's time by rows; with ``--onednn``, a
forward of M new tokens in milliseconds with torch's oneDNN matmuls on (its default) and off, toggled per forward in
the same process (:func:`hf_retrace.machine.onednn_matmuls`), interleaved.

    python examples/verify_cost_by_dtype.py --dtypes bf16,fp32      # alone on the machine: it times
    python examples/verify_cost_by_dtype.py --dtypes bf16 --onednn  # where oneDNN's bf16 path is slower for few rows

On CPUs without bf16 units (AVX2 only) a bf16 matmul costs in proportion to its rows, so a 16-token verify costs
several steps; in fp32 it costs less than 2, but the one-token step is slower.
"""

import argparse
import statistics
import time

import torch

from hf_retrace.loading import load_target, torch_dtype
from hf_retrace.machine import onednn_matmuls
from hf_retrace.tuning.costs import measure_verify_costs

parser = argparse.ArgumentParser()
parser.add_argument("--target", default=None)
parser.add_argument("--dtypes", default="bf16,fp32")
parser.add_argument("--max-drafts", type=int, default=15)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--onednn", action="store_true", help="time a forward of M new tokens with oneDNN on and off")
args = parser.parse_args()
torch.set_num_threads(args.threads)


def milliseconds(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


if not args.onednn:
    for name in args.dtypes.split(","):
        target, _ = load_target(args.target, name)
        config = target.config.get_text_config()
        weight = torch.randn(config.intermediate_size, config.hidden_size).to(torch_dtype(name))
        with torch.inference_mode():
            costs = measure_verify_costs(target, args.max_drafts)
            rows = {}
            for m in (1, 2, 4, 8, 16):
                x = torch.randn(1, m, config.hidden_size).to(weight.dtype)
                rows[m] = milliseconds(lambda: torch.nn.functional.linear(x, weight))
        print(f"{name}: verify cost of k drafts (x one cached step of this dtype): "
              + ", ".join(f"{k}:{c:.2f}" for k, c in enumerate(costs)))
        print(f"{name}: linear {config.hidden_size}->{config.intermediate_size} by rows (ms): "
              + ", ".join(f"{m}:{t:.3f}" for m, t in rows.items()), flush=True)


def onednn_on_and_off(target, context: int = 256, repeats: int = 25) -> None:
    """A forward of M new tokens on a ``context``-token cache, median of ``repeats``, oneDNN on against off."""
    torch.manual_seed(0)
    news = (1, 2, 3, 4, 5, 7, 9, 17, 33)
    times: dict[tuple[int, bool], list[float]] = {}
    with torch.inference_mode():
        cache = target(torch.randint(100, 20000, (1, context)), use_cache=True).past_key_values
        for _ in range(repeats):
            for m in news:
                x = torch.randint(100, 20000, (1, m))
                for on in (True, False):
                    with onednn_matmuls(on):
                        started = time.perf_counter()
                        target(x, past_key_values=cache, use_cache=True)
                        times.setdefault((m, on), []).append(time.perf_counter() - started)
                    cache.crop(-m)  # negative: drop the m new positions (transformers 4.57 and 5.x)
    print("| new tokens | oneDNN on (ms) | off (ms) | on / off |\n|---|---|---|---|")
    for m in news:
        on, off = (1000 * statistics.median(times[(m, flag)]) for flag in (True, False))
        print(f"| {m} | {on:.1f} | {off:.1f} | {on / off:.2f} |", flush=True)


if args.onednn:
    for name in args.dtypes.split(","):
        print(f"{name}:")
        onednn_on_and_off(load_target(args.target, name)[0])
