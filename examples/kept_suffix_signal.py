import torch, hf_retrace
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from hf_retrace.training.data import TokenizedDataset
from hf_retrace.training.features import collate_sequences
from hf_retrace.training.retrace_stage import ReTraceObjective
t = AutoModelForCausalLM.from_pretrained('/root/.cache/hf_retrace/smollm2-135m-instruct', dtype=torch.bfloat16).eval()
d = hf_retrace.ReTraceDrafter.from_pretrained('runs/rt-probe/backbone', dtype=torch.bfloat16)
obj = ReTraceObjective(d, t, num_anchors=16)
ds = TokenizedDataset('work_data/smollm2-tokenized')
tot = torch.zeros(15); hit_t = torch.zeros(15); hit_d = torch.zeros(15)
for i in range(4000, 4012):
    b = collate_sequences([ds[i]])
    with torch.no_grad():
        first = obj._first_pass(b)
        nxt, al = obj.align_next_block(first, 16)
        labels, valid = obj.labels(b['input_ids'], b['loss_mask'], b['attention_mask'].sum(1), nxt, first['anchor_valid'])
    labels = labels.reshape(-1, 15); valid = valid.reshape(-1, 15) & al.valid
    tot += valid.sum(0); hit_t += ((al.target_tokens == labels) & valid).sum(0); hit_d += ((al.rejected_tokens == labels) & valid).sum(0)
    print(i, 'first-pass accepted mean', first['accepted'].float().mean().item())
print('slot', list(range(1,16)))
print('P(t==label)', [round(x,2) for x in (hit_t/tot.clamp(min=1)).tolist()])
print('P(d==label)', [round(x,2) for x in (hit_d/tot.clamp(min=1)).tolist()])
print('count', tot.tolist())
