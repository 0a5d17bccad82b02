"""Tuning the round policy to the machine it runs on: measured costs, replayed rounds, a cached choice.

- :mod:`.costs`: the target's verify cost for ``k`` drafts and the drafter's round cost, in one-token target steps,
  timed on this machine (synchronised on accelerators).
- :mod:`.records`: the rounds a drafter ships (its teacher-forced drafts on the target's own answers to held-out
  training prompts, at T=0 and T=1), compact, in the drafter's folder.
- :mod:`.replay`: one walker over recorded answers that asks the same :class:`~hf_retrace.generation.policy.RoundPolicy`
  methods the generator asks, so the replay and a real call agree round by round.
- :mod:`.search`: the policy with the most tokens per step-cost, per temperature; plain decoding where none pays.
- :mod:`.auto`: the resolver ``generate`` consults: ``HF_RETRACE_POLICY``, the cache, or tuning at first use; and the
  observer that records the first real calls' figure beside the prediction.
- :mod:`.verify`: ``hf-retrace tune --verify``, a short real A/B of plain, the choice and the runner-up.
"""
