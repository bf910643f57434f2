"""Writing the tiny checkpoint, and the embedded default model generated on first use.

A checkpoint directory holds what transformers and trnrt load offline: `config.json`,
`model.safetensors`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` and
`chat_template.jinja`. Same seed => byte-identical files (nothing time- or path-dependent is
written). torch and transformers are imported inside functions: the CLI imports this module's
package at start-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from trnrt.models.cache_dir import cache_dir  # noqa: F401  (its old home)
from trnrt.models.tiny.build import TINY_MTP_CONFIG, TINY_TEXT_CONFIG, TINY_VISION_CONFIG, add_mtp_layer, build_hf_model

# Bump when the checkpoint's content changes in a way the digest below cannot see.
TINY_CHECKPOINT_VERSION = 1

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
CHECKPOINT_FILES: tuple[str, ...] = (
    "chat_template.jinja", "config.json", "generation_config.json",
    "model.safetensors", "tokenizer.json", "tokenizer_config.json",
)


def write_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, train_steps: int = 0) -> Path:
    """Write the tiny GLM-5.3-Flash checkpoint for `seed` into `out_dir`; return its path.

    `train_steps` > 0 trains the random weights that many steps on the tiny corpus first
    (trnrt.models.tiny.train: a model with clear favourites, for accuracy measurements).

    The files are written to a temporary sibling directory and renamed into place, so a reader
    never sees a half-written checkpoint. An existing empty `out_dir`, or an existing checkpoint
    (a directory with config.json), is replaced; any other existing path raises FileExistsError.
    """
    from transformers import GenerationConfig

    from trnrt.models.tiny.tokenizer import (
        EOS_TOKEN, PAD_TOKEN, STOP_TOKENS, build_tokenizer, write_tokenizer_files,
    )

    out = Path(out_dir).absolute()
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp) so the directory gets the umask's permissions, not 0700.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        tokenizer = build_tokenizer()
        ids = write_tokenizer_files(tmp, tokenizer)
        stop_ids = [ids[s] for s in STOP_TOKENS]
        model = build_hf_model(
            seed, text_overrides={"pad_token_id": ids[PAD_TOKEN], "eos_token_id": stop_ids}
        )
        if train_steps > 0:
            from trnrt.models.tiny.train import corpus_ids, train_

            train_(model, corpus_ids(tokenizer), train_steps, seed)
        # The multimodal placeholder ids default to the real vocabulary's (154854, ...): point them
        # at this tokenizer's tokens so the config never names an id outside the embedding.
        cfg = model.config
        cfg.image_token_id = ids["<|image|>"]
        cfg.video_token_id = ids["<|video|>"]
        cfg.image_start_token_id = ids["<|begin_of_image|>"]
        cfg.image_end_token_id = ids["<|end_of_image|>"]
        cfg.video_start_token_id = ids["<|begin_of_video|>"]
        cfg.video_end_token_id = ids["<|end_of_video|>"]
        # Only stop and pad ids: sampling defaults here would become every request's defaults.
        model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=ids[EOS_TOKEN])
        with _quiet_progress_bars():
            model.save_pretrained(tmp)
        add_mtp_layer(tmp, seed)  # after, from its own generator: the base weights are unchanged
        shutil.copyfile(CHAT_TEMPLATE_PATH, tmp / "chat_template.jinja")
        # transformers writes model.safetensors 0600 (via a private temp file); give every file
        # the umask's mode, the one the tokenizer files were just created with.
        mode = (tmp / "tokenizer.json").stat().st_mode & 0o777
        for p in tmp.iterdir():
            p.chmod(mode)
        written = sorted(p.name for p in tmp.iterdir())
        if written != sorted(CHECKPOINT_FILES):
            raise RuntimeError(f"unexpected checkpoint files {written}, expected {sorted(CHECKPOINT_FILES)}")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def _quiet_progress_bars():
    # save_pretrained draws a "Writing model shards" bar on stderr; noise for a 4 MB file.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_replaceable(out: Path) -> None:
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "config.json").is_file())):
        raise FileExistsError(f"{out} exists and is neither empty nor a checkpoint; refusing to overwrite it")


def _replace_dir(tmp: Path, out: Path) -> None:
    # rename() of a directory onto a non-empty one fails, so an old checkpoint is moved aside first.
    _check_replaceable(out)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def default_model_name() -> str:
    """Cache-directory name of the embedded default model, e.g. `glm5-next-tiny-v1-<digest>`.

    The digest covers everything that decides the files (configs, corpus, template, the code that
    writes them, the transformers and tokenizers versions), so an edit never reuses a stale cache
    even if nobody bumps TINY_CHECKPOINT_VERSION.
    """
    from importlib import metadata

    h = hashlib.sha256()
    h.update(f"v{TINY_CHECKPOINT_VERSION}\n".encode())
    h.update(json.dumps([TINY_TEXT_CONFIG, TINY_VISION_CONFIG, TINY_MTP_CONFIG], sort_keys=True).encode())
    for pkg in ("transformers", "tokenizers"):
        h.update(f"{pkg}={metadata.version(pkg)}\n".encode())
    here = Path(__file__).parent
    for name in ("__init__.py", "build.py", "checkpoint.py", "tokenizer.py", "corpus.txt", "chat_template.jinja"):
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    return f"glm5-next-tiny-v{TINY_CHECKPOINT_VERSION}-{h.hexdigest()[:12]}"


def default_model_dir() -> Path:
    """The embedded default model (seed 0), written into the cache on first use.

    Safe when several processes call it at once: the first takes an exclusive file lock and
    writes; the others wait on the lock and then find the finished directory (it appears only
    by an atomic rename, so its existence means it is complete).
    """
    import fcntl

    root = cache_dir()
    name = default_model_name()
    final = root / name
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if not (final / "config.json").is_file():
                write_tiny_checkpoint(final, seed=0)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final
