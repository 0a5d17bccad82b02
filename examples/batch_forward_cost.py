"""What a batched target forward costs as the tuner's old clean probe ran it and as the batch loops run it (issue 39).

    python examples/batch_forward_cost.py --rows 4 8 [--repeats 12]

For each batch size and verify width k (0: a one-token step), four forwards over a 256-slot cache of random keys,
timed in a shuffled order, medians printed: ``clean`` (no mask: the old probe), ``ones`` (an all-ones 2-D mask),
``pad`` (every other row left-padded by 32 slots, per-row positions: plain batched ``generate``'s step) and
``pad+masked`` (also 128 masked slots per row: the batch loop's cache before a compaction). The default target,
bf16, two threads; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from hf_retrace.defaults import ensure_default_target
from hf_retrace.generation.target_features import cache_kwargs
from hf_retrace.tuning.costs import _context_cache, _verify_probe

CONTEXT = 256


def forward(target, rows: int, k: int, masked: int, pad: int):
    """A callable running one forward of ``k + 1`` tokens a row over a cache shaped as described above."""
    slots = CONTEXT + masked
    ids = torch.randint(0, target.config.vocab_size, (rows, slots + k + 1), generator=torch.Generator().manual_seed(0))
    cache = _context_cache(target, ids, slots)
    mask = torch.ones(rows, slots + k + 1, dtype=torch.long)
    generator = torch.Generator().manual_seed(2)
    for row in range(rows):
        mask[row, : pad if row % 2 else 0] = 0
        if masked:
            mask[row, 64 + torch.randperm(slots - 64, generator=generator)[:masked]] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, slots:]

    def run() -> None:
        target(input_ids=ids[:, slots:], attention_mask=mask, position_ids=positions, use_cache=True,
               **cache_kwargs(target, cache))
        cache.crop(-(k + 1))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[0, 3, 7])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    target = AutoModelForCausalLM.from_pretrained(ensure_default_target(), dtype=torch.bfloat16).eval()
    cells = {}
    for rows in args.rows:
        clean = _verify_probe(target, max(args.widths), CONTEXT, rows, batched=False)
        for k in args.widths:
            cells[(rows, k, "clean")] = lambda k=k, clean=clean: clean(k)
            cells[(rows, k, "ones")] = forward(target, rows, k, 0, 0)
            cells[(rows, k, "pad")] = forward(target, rows, k, 0, 32)
            cells[(rows, k, "pad+masked")] = forward(target, rows, k, 128, 32)
    times = {cell: [] for cell in cells}
    for run in cells.values():
        run()  # warm-up
    for repeat in range(args.repeats):
        order = list(cells)
        random.Random(repeat).shuffle(order)
        for cell in order:
            started = time.perf_counter()
            cells[cell]()
            times[cell].append(time.perf_counter() - started)
    for (rows, k, name), values in times.items():
        print(f"rows {rows} k {k} {name:11s} median {statistics.median(values) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
