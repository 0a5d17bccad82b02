"""The grid's six T=0 outputs flagged "bug" (all HumanEval/24, position 86, in six static cells): plain decoding with
oneDNN on and off, the target's logits there from a one-token step and from one forward over the whole sequence
(bf16), and the same static policy against plain decoding in float32.

    python flagged_check.py"""
import torch
import hf_retrace  # noqa: F401
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.machine import onednn_matmuls

torch.set_num_threads(2)
target, tok = load_target(None)
prompt = next(p for p in load_prompts("humaneval", limit=8) if p.id == "HumanEval/24")
ids = torch.tensor([prompt_token_ids(tok, [prompt.turns[0]])[0]])
answers = {}
for on in (True, False):
    with onednn_matmuls(on):
        answers[on] = target.generate(ids, max_new_tokens=128, do_sample=False)[0, ids.shape[1]:].tolist()
print("bf16 plain, oneDNN on and off, identical:", answers[True] == answers[False], "; token 86:", answers[True][86])
seq = torch.tensor([ids[0].tolist() + answers[True][:86]])
with torch.no_grad():
    whole = target(seq).logits[0, -1].float()
    cached = target(seq[:, :-1], use_cache=True)
    step = target(seq[:, -1:], past_key_values=cached.past_key_values).logits[0, -1].float()
for name, logits in (("one-token step on a cache", step), ("one forward over the whole sequence", whole)):
    print(f"bf16 {name}: token 378 {logits[378].item():.4f}, token 2 {logits[2].item():.4f}")
target32, _ = load_target(None, dtype=torch.float32)
drafter32 = load_drafter(None).to(torch.float32)
plain32 = target32.generate(ids, max_new_tokens=128, do_sample=False)
for cut, cap in ((None, 4), (None, 8), (None, 16), (0.3, 4), (0.3, 8), (0.3, 16)):
    view = drafter32.with_policy(RoundPolicy(confidence_cut=cut, lookup=True, lookup_start=2, lookup_cap=cap,
                                             source="static"))
    same = torch.equal(plain32, target32.generate(ids, max_new_tokens=128, do_sample=False, assistant_model=view))
    print(f"float32 static-{'full' if cut is None else cut}-{cap} equals plain generate:", same)
