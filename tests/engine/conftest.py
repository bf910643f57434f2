"""Fixtures shared by the scripted-engine tests of this directory (no torch, no transformers)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny model's tokenizer as a bare `tokenizers.Tokenizer` (Rust; no transformers, no torch)."""
    from tokenizers import Tokenizer

    from trnrt.models.tiny.tokenizer import write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos(tok) -> int:
    from trnrt.models.tiny.tokenizer import EOS_TOKEN

    return tok.token_to_id(EOS_TOKEN)
