"""Speculative decoding: MTP drafts verified in one target pass (issue #18).

    rejection.py  the acceptance rule: greedy, and rejection sampling for sampled rows (pure torch)
    drafter.py    the Drafter interface and the MTP drafter (k steps of model.forward_mtp)
    oracle.py     TEST ONLY: drafts replayed from a recorded greedy run, chosen positions corrupted
    verify.py     the target over [last, d_1 .. d_k] per row + the rule (VerifyFunction)
    rollback.py   slot snapshots through the prefix cache's checkpoint pool; what rejected
                  positions leave behind and why it is safe (the indexer tail, pages)
    pages.py      the k + 1 look-ahead tokens a verify writes into
    prefill.py    the runner's prefill, keeping every position's hidden state for the drafter
    decoder.py    SpecDecoder: draft -> snapshot -> verify -> rollback -> observe, per step
    draft_step.py the `draft` graph: the MTP layer's k steps as one fixed-shape call
    runner.py     SpecModelRunner: speculative rows through the decoder, the rest as ModelRunner
    config.py     SpeculativeConfig, SGLang's / vLLM's flags, the mtp-* presets' defaults
    policy.py     DynamicSpeculation: which requests speculate under a dynamic preset (pure Python)
"""
