"""A briefly trained tiny model: `trnrt make-tiny DIR --train-steps N`.

The random tiny model is flat on purpose-free text: its logits over 4096 tokens have std ~1, and
on ~20 % of positions the top two are within 0.05 of each other, so rounding alone decides the
argmax there (its own bf16 model matches its fp32 argmax on only ~97 % of positions). Accuracy
claims about a weight format (FP8 against bf16: "greedy agreement >= 95 %") are meaningless on it:
they measure ties, not the format. A model trained for a few dozen steps on the tiny corpus has a
clear favourite at most positions of corpus text, like a real model on in-distribution text, so
the same measurement then says what it says for a released model.

Training is plain next-token cross-entropy through the transformers model (fp32, AdamW), on
windows of a fixed slice of the shipped corpus, with its own generator: the same seed, steps and
torch thread count give the same weights. The MTP layer is added afterwards from its own stream,
as for the random model (it stays random).
"""

from __future__ import annotations

# The corpus slice trained on (tokens) and the window: small enough that a few dozen steps make
# the model confident on it, which is all an accuracy comparison of weight formats needs.
TRAIN_TOKENS = 4096
WINDOW = 64
BATCH = 4
LEARNING_RATE = 1e-2


def corpus_ids(tokenizer) -> list[int]:
    """The first TRAIN_TOKENS token ids of the shipped corpus (prompts for evaluation come from here)."""
    from trnrt.models.tiny.tokenizer import CORPUS_PATH

    return tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8")).ids[:TRAIN_TOKENS]


def train_(model, ids: list[int], steps: int, seed: int = 0) -> list[float]:
    """Train the transformers `model` in place for `steps` AdamW steps on windows of `ids`;
    return the loss of each step. Leaves the model in eval mode."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)  # [T]
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        start = torch.randint(0, len(ids) - WINDOW, (BATCH,), generator=gen)  # [B]
        x = torch.stack([data[s: s + WINDOW] for s in start.tolist()])  # [B, S]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses
