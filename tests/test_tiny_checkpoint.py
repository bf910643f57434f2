"""The tiny checkpoint: deterministic files, loadable by transformers, every layer kind present."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.models.tiny import TINY_VOCAB_SIZE, write_tiny_checkpoint
from trnrt.models.tiny.checkpoint import CHECKPOINT_FILES
from trnrt.models.tiny.tokenizer import GLM_SPECIAL_TOKENS, STOP_TOKENS


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_make_tiny_cli_is_deterministic(tiny_dir, tmp_path):
    runner = CliRunner()
    r0 = runner.invoke(app, ["make-tiny", str(tmp_path / "again")])
    assert r0.exit_code == 0, r0.output
    assert "model.safetensors" in r0.output
    r1 = runner.invoke(app, ["make-tiny", str(tmp_path / "seed1"), "--seed", "1"])
    assert r1.exit_code == 0, r1.output

    ref, again, seed1 = _files(tiny_dir), _files(tmp_path / "again"), _files(tmp_path / "seed1")
    assert sorted(ref) == sorted(CHECKPOINT_FILES)
    assert again == ref  # every file byte-identical for the same seed
    assert seed1["model.safetensors"] != ref["model.safetensors"]
    assert {k: v for k, v in seed1.items() if k != "model.safetensors"} == {
        k: v for k, v in ref.items() if k != "model.safetensors"
    }
    # Nothing machine-specific leaks into the files.
    for name, data in ref.items():
        assert str(tiny_dir).encode() not in data, name

    # A directory that is not a checkpoint is never overwritten.
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    r2 = runner.invoke(app, ["make-tiny", str(tmp_path / "precious")])
    assert r2.exit_code == 2
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_tokenizer_round_trip_and_special_tokens(hf_tokenizer):
    tok = hf_tokenizer
    assert len(tok) == TINY_VOCAB_SIZE
    text = "[gMASK]<sop><|user|>héllo 世界 🙂<|assistant|><think>x</think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids  # no automatic BOS/EOS: [gMASK]<sop> come from the template
    for s in GLM_SPECIAL_TOKENS:
        one = tok.encode(s, add_special_tokens=False)
        assert len(one) == 1, s
        assert tok.convert_ids_to_tokens(one) == [s]
        assert f"a{s}b" in tok.decode(tok.encode(f"a{s}b", add_special_tokens=False))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    # Special ids sit after the BPE tokens, as in GLM; ordinary text never produces them.
    special_ids = {tok.convert_tokens_to_ids(s) for s in GLM_SPECIAL_TOKENS}
    plain = tok.encode("Plain words, numbers 12345 and code: def f(x): return x", add_special_tokens=False)
    assert not special_ids & set(plain)
    assert min(special_ids) == TINY_VOCAB_SIZE - len(GLM_SPECIAL_TOKENS)


def test_tokenizer_training_is_deterministic_across_processes():
    # tokenizers' trainer runs in Rust threads with per-process hash seeds: compare fresh processes.
    code = (
        "import hashlib; from trnrt.models.tiny.tokenizer import build_tokenizer; "
        "print(hashlib.sha256(build_tokenizer().to_str().encode()).hexdigest())"
    )
    digests = set()
    for i in range(2):
        env = {**os.environ, "PYTHONHASHSEED": str(i), "RAYON_NUM_THREADS": str(1 + i)}
        run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
        digests.add(run.stdout.strip())
    assert len(digests) == 1


def test_loads_and_runs_with_transformers(tiny_dir, hf_tokenizer):
    import torch
    from transformers import AutoConfig, Glm5NextForConditionalGeneration, GenerationConfig

    cfg = AutoConfig.from_pretrained(str(tiny_dir))
    assert cfg.model_type == "glm5_next"
    tok = hf_tokenizer
    stop = [tok.convert_tokens_to_ids(s) for s in STOP_TOKENS]
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    gen = GenerationConfig.from_pretrained(str(tiny_dir))
    assert gen.eos_token_id == stop
    assert gen.pad_token_id == eot
    assert cfg.text_config.pad_token_id == eot
    assert cfg.text_config.eos_token_id == stop
    assert cfg.text_config.vocab_size == TINY_VOCAB_SIZE
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image|>")
    assert cfg.video_end_token_id == tok.convert_tokens_to_ids("<|end_of_video|>")

    model = Glm5NextForConditionalGeneration.from_pretrained(str(tiny_dir)).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], TINY_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights with O(1) activations, not a near-constant output


def test_config_covers_every_layer_kind(tiny_dir):
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(str(tiny_dir)).text_config
    assert {"linear_attention", "indexed_attention"} <= set(t.layer_types)
    kinds = [k for lt, k in zip(t.layer_types, t.indexer_types) if lt == "indexed_attention"]
    assert "full" in kinds and "shared" in kinds
    for i, (lt, k) in enumerate(zip(t.layer_types, t.indexer_types)):
        if lt == "indexed_attention" and k == "shared":
            # transformers accepts a shared layer only directly after a full indexed one
            assert i > 0 and t.layer_types[i - 1] == "indexed_attention" and t.indexer_types[i - 1] == "full"
    assert {"dense", "sparse"} <= set(t.mlp_layer_types)
    assert t.n_routed_experts >= 8 and t.num_experts_per_tok > 1
    assert t.n_group > 1 and t.topk_group < t.n_group
    assert t.hc_mult == 4
    assert t.index_topk + t.index_kpool - 1 < 32  # sparse selection within 32 tokens
    assert t.index_topk % t.index_kpool == 0
    assert t.index_n_heads >= 16


def test_checkpoint_has_an_mtp_layer_and_the_base_weights_are_unchanged(tiny_dir):
    """The embedded checkpoint carries one MTP layer (layers.{N}.*, release naming); every base
    tensor is byte-identical to the checkpoint as it was before it had one (the MTP weights come
    from a generator of their own, after the base weights)."""
    import json

    import torch
    from safetensors.torch import load_file

    from trnrt.models.glm5_next.weights import load_model

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from glm5_helpers import BASE_TENSORS_SHA256, base_tensors_digest

    text = json.loads((tiny_dir / "config.json").read_text())["text_config"]
    assert text["num_nextn_predict_layers"] == 1 and text["index_share_for_mtp_iteration"] is True
    n = text["num_hidden_layers"]
    sd = load_file(str(tiny_dir / "model.safetensors"))
    mtp = {k for k in sd if k.startswith(f"model.language_model.layers.{n}.")}
    assert len(mtp) == 49 and f"model.language_model.layers.{n}.eh_proj.weight" in mtp
    assert base_tensors_digest({k: v for k, v in sd.items() if k not in mtp}) == BASE_TENSORS_SHA256
    m = load_model(tiny_dir, load_mtp=True)
    assert torch.equal(m.mtp.eh_proj.weight, sd[f"model.language_model.layers.{n}.eh_proj.weight"])


def test_swiglu_clamp_bites(tiny_dir, hf_tokenizer):
    import torch
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(str(tiny_dir)).eval()
    t = model.config.text_config
    layers = model.model.language_model.layers
    dense = [i for i, k in enumerate(t.mlp_layer_types) if k == "dense"]
    assert dense
    seen: list[float] = []
    hooks = [
        getattr(layers[i].mlp, proj).register_forward_hook(lambda m, a, out: seen.append(out.abs().max().item()))
        for i in dense for proj in ("gate_proj", "up_proj")
    ]
    ids = hf_tokenizer.encode("The quiet river crossed the old bridge near the station, and nobody noticed "
                              "until the lantern went out at midnight in Lisbon. 1234 🙂", add_special_tokens=False)
    ids = torch.tensor([(ids * 4)[:32]])
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 2 * len(dense)
    assert max(seen) > t.swiglu_limit  # values above the limit exist, so the clamp changes something


def _fake_writer(out_dir, seed=0):
    # Stands in for the real writer in the concurrency test: slow, and counts its calls.
    out = Path(out_dir)
    with open(out.parent / "calls.txt", "a") as f:
        f.write("x")
    tmp = out.parent / f".tmp-{multiprocessing.current_process().pid}"
    tmp.mkdir()
    time.sleep(0.3)
    (tmp / "config.json").write_text("{}")
    tmp.rename(out)
    return out


def _call_default_model_dir(q):
    from trnrt.models.tiny import checkpoint

    checkpoint.write_tiny_checkpoint = _fake_writer
    q.put(str(checkpoint.default_model_dir()))


def test_default_model_dir_is_written_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_call_default_model_dir, args=(q,)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    paths = {q.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    assert (tmp_path / "calls.txt").read_text() == "x"
    assert "-v" in Path(paths.pop()).name  # the name carries the content version


def test_default_model_dir_is_the_seed0_checkpoint(tiny_dir, tmp_path, monkeypatch):
    from trnrt.models.paths import resolve_model_dir
    from trnrt.models.tiny import default_model_dir

    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "cache"))
    d = default_model_dir()
    assert d.parent == tmp_path / "cache"
    assert _files(d) == _files(tiny_dir)
    assert resolve_model_dir(None) == d
    assert default_model_dir() == d  # reused, not rewritten
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_cache_dir_precedence(tmp_path, monkeypatch):
    from trnrt.models.tiny import cache_dir

    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TRNRT_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "trnrt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "trnrt"


def test_resolve_model_dir(tiny_dir, tmp_path):
    from trnrt.models.paths import resolve_model_dir

    assert resolve_model_dir(str(tiny_dir)) == tiny_dir
    assert resolve_model_dir(tiny_dir) == tiny_dir
    with pytest.raises(ValueError, match="missing-model"):
        resolve_model_dir(str(tmp_path / "missing-model"))
    with pytest.raises(ValueError, match="zai-org/GLM-5.3-Flash"):
        resolve_model_dir("zai-org/GLM-5.3-Flash")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))


def test_cli_module_does_not_import_torch():
    code = "import sys, trnrt.cli, trnrt.cli.make_tiny; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
