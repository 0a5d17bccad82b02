"""Re-check a bf16 benchmark request flagged "bug" (a parting from plain `generate` wider than NEAR_TIE_ULPS bf16 ulps)
in float32 (first turns), where the lossless rule is exact: plain greedy `generate` against the same call with the
drafter, in full blocks and under the default policy. Identical outputs mean the bf16 parting was the kernels' rounding (a many-token
verify and a one-token step sum in different orders), not the drafting.

    python examples/check_flagged.py --dataset math500 --prompt-id test/intermediate_algebra/1197.json \
        [--drafter FOLDER] [--max-new-tokens 128]

It also says whether plain bf16 decoding parts from itself with oneDNN's matmuls off (the bench's `plain-no-onednn`):
kernels alone moving a greedy output.
"""

import argparse

import torch

import hf_retrace  # noqa: F401
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.machine import onednn_matmuls

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--dataset", required=True)
parser.add_argument("--prompt-id", required=True)
parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped drafter)")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--limit", type=int, default=8, help="the bench's --limit (which prompts were loaded)")
args = parser.parse_args()

torch.set_num_threads(2)
prompts = load_prompts(args.dataset, limit=args.limit)
prompt = next((p for p in prompts if p.id == args.prompt_id), None)
if prompt is None:
    raise SystemExit(f"check_flagged: no prompt {args.prompt_id!r} among {args.dataset}'s first {args.limit}: "
                     f"{[p.id for p in prompts]}")
target, tok = load_target(None)
ids = torch.tensor([prompt_token_ids(tok, [prompt.turns[0]])[0]])
answers = {}
for on in (True, False):
    with onednn_matmuls(on):
        answers[on] = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1]:]
print("bf16 plain generate, oneDNN matmuls on and off, identical:", torch.equal(answers[True], answers[False]))

target32, _ = load_target(None, dtype=torch.float32)
drafter32 = load_drafter(args.drafter).to(torch.float32)
plain32 = target32.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
for name, policy in (("full blocks", RoundPolicy(confidence_cut=None, lookup=False, source="static")),
                     ("the default's shape (full blocks, lookup 4..32)",
                      RoundPolicy(confidence_cut=None, lookup=True, lookup_start=4, lookup_cap=32, source="static"))):
    out = target32.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                            assistant_model=drafter32.with_policy(policy))
    print(f"float32, the drafter in {name}, equals plain generate token for token:", torch.equal(plain32, out))
