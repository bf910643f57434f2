"""FP8 vs bf16 accuracy on the tiny model, random and briefly trained (issue #32).

For each model: the FP8 checkpoint quantized from the bf16 one (make-tiny --fp8 [--train-steps N]),
both loaded in bfloat16, teacher-forced on the bf16 model's greedy continuations of 8 prompts x 32
tokens (256 positions); and, for scale, the same bf16 model against its own fp32 load. Prints the
argmax agreement and the mean |dlogprob| of the bf16 greedy token.

    PYTHONPATH=. python scripts/fp8_accuracy.py [--train-steps 60]     # ~1-2 min on 2 cores
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))

from glm5_helpers import tokens  # noqa: E402
from test_fp8_checkpoint import PROMPTS, P, _agreement  # noqa: E402

from trnrt.models.glm5_next.fp8.checkpoint import convert_dir  # noqa: E402
from trnrt.models.glm5_next.loading import load_model  # noqa: E402
from trnrt.models.tiny import write_tiny_checkpoint  # noqa: E402
from trnrt.models.tiny.tokenizer import build_tokenizer  # noqa: E402
from trnrt.models.tiny.train import corpus_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = corpus_ids(build_tokenizer())
    corpus = [torch.tensor(ids[300 * i + 7: 300 * i + 7 + P]) for i in range(PROMPTS)]
    rand = [tokens(100 + i, P) for i in range(PROMPTS)]
    print("| model | prompts | FP8 vs bf16 agreement | where top-2 gap > 0.1 | mean abs dlogprob | bf16 vs fp32 agreement |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, steps in (("random", 0), (f"trained {args.train_steps} steps", args.train_steps)):
            b = write_tiny_checkpoint(Path(tmp) / f"bf16-{steps}", train_steps=steps)
            f = Path(tmp) / f"fp8-{steps}"
            shutil.copytree(b, f)
            convert_dir(f)
            ref, m8, m32 = (load_model(b, dtype=torch.bfloat16), load_model(f, dtype=torch.bfloat16),
                            load_model(b, dtype=torch.float32))
            for pname, prompts in (("corpus", corpus), ("random ids", rand)):
                agree, clear, dlp = _agreement(ref, m8, prompts)
                a32, _, _ = _agreement(m32, ref, prompts)
                print(f"| {name} | {pname} | {agree:.1%} | {clear:.1%} | {dlp:.3f} | {a32:.1%} |", flush=True)


if __name__ == "__main__":
    main()
