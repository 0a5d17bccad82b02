"""The one-line swap: `target.generate(**inputs, assistant_model=drafter)`.

Runs offline on the embedded default (SmolLM2-135M-Instruct + the drafter shipped with hf_retrace), or on any
target/drafter pair:  python examples/quickstart.py [TARGET] [DRAFTER]
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_retrace
from hf_retrace import defaults

target_path = sys.argv[1] if len(sys.argv) > 1 else defaults.ensure_default_target()
drafter_path = sys.argv[2] if len(sys.argv) > 2 else defaults.default_drafter_path()

tokenizer = AutoTokenizer.from_pretrained(target_path)
target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
drafter = hf_retrace.ReTraceDrafter.from_pretrained(drafter_path, dtype=torch.float32)

messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

plain = target.generate(**inputs, max_new_tokens=96, do_sample=False)
fast = target.generate(**inputs, max_new_tokens=96, do_sample=False, assistant_model=drafter)  # the one-line swap

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"\nidentical to plain greedy (fp32): {torch.equal(plain, fast)}")
print(f"tau (tokens per target forward): {drafter.last_stats.mean_acceptance_length:.2f}")
