"""The tiny checkpoint's tokenizer: a real byte-level BPE with GLM's special tokens.

The BPE is trained on `corpus.txt` (shipped next to this file) every time a checkpoint is
written. Training is deterministic (the `tokenizers` BPE trainer breaks count ties by pair, not
by hash order or thread timing), so the same corpus gives the same `tokenizer.json` bytes.

The layout mirrors GLM's: ordinary BPE tokens first, the special tokens appended after them, so
their ids are large and nothing can get away with assuming `<|endoftext|>` is 0. Ids differ from
the real model's (154820, ...): code must look them up by string, never hard-code them.
"""

from __future__ import annotations

import json
from pathlib import Path

from trnrt.models.tiny.build import TINY_TEXT_CONFIG, TINY_VOCAB_SIZE

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

# GLM-4.5 .. GLM-5.3's added tokens, in GLM's id order (../shared/reference/glm5_next.md §7).
# All are special (never split, dropped by skip_special_tokens), `/nothink` included, as in GLM.
GLM_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
# A GLM assistant turn ends with the next role token, so these three all stop generation.
STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")

# Pre-tokenisation split as in GLM's tokenizer.json (the cl100k-style pattern: contractions,
# letter runs with one leading non-letter, digits in groups of at most 3, punctuation runs,
# newlines, spaces); ByteLevel then maps bytes to printable characters without re-splitting.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer():
    """Train the tiny byte-level BPE on the shipped corpus and add GLM's special tokens.

    Returns a `tokenizers.Tokenizer` with exactly `TINY_VOCAB_SIZE` entries (every id the tiny
    model can sample decodes to something). Same corpus and `tokenizers` version => same bytes.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # No BOS/EOS added on encode: `[gMASK]<sop>` comes from the chat template, as in GLM.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(GLM_SPECIAL_TOKENS),
        # min_frequency 1 so the corpus fills the vocabulary exactly.
        min_frequency=1,
        # All 256 byte symbols, so any UTF-8 input is encodable even if the corpus lacks a byte.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GLM_SPECIAL_TOKENS])
    if tok.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} entries, expected {TINY_VOCAB_SIZE}; "
            "the corpus is too small to fill the BPE vocabulary"
        )
    return tok


def special_token_ids(tok) -> dict[str, int]:
    """Map every GLM special string to its id in `tok` (a `tokenizers.Tokenizer`)."""
    ids = {s: tok.token_to_id(s) for s in GLM_SPECIAL_TOKENS}
    missing = [s for s, i in ids.items() if i is None]
    if missing:
        raise RuntimeError(f"tokenizer lacks special tokens {missing}")
    return ids


def write_tokenizer_files(out_dir: Path, tok=None) -> dict[str, int]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`.

    Returns the special-token ids. The config is written by hand (not via transformers'
    `save_pretrained`) so its bytes do not depend on the save path; it has the keys transformers
    5.23 itself writes for a `TokenizersBackend`.
    """
    tok = tok if tok is not None else build_tokenizer()
    out_dir = Path(out_dir)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # NoPE: max_position_embeddings is informational; it is still the tiny model's nominal span.
        "model_max_length": TINY_TEXT_CONFIG["max_position_embeddings"],
        "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return special_token_ids(tok)
