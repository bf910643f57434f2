"""Speculative decoding at the runner level (issue #18 part 2; eager, no scheduler yet).

    rejection.py  the acceptance rule: greedy, and rejection sampling for sampled rows (pure torch)
    drafter.py    the Drafter interface and the MTP drafter (k steps of model.forward_mtp)
    oracle.py     TEST ONLY: drafts replayed from a recorded greedy run, chosen positions corrupted
    verify.py     the target over [last, d_1 .. d_k] per row + the rule (VerifyFunction)
    rollback.py   slot snapshots through the prefix cache's checkpoint pool; what rejected
                  positions leave behind and why it is safe (the indexer tail, pages)
    pages.py      the k + 1 look-ahead tokens a verify writes into
    prefill.py    the runner's prefill, keeping every position's hidden state for the drafter
    decoder.py    SpecDecoder: draft -> snapshot -> verify -> rollback -> observe, per step
"""
