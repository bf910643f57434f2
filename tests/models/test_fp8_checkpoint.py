"""The tiny FP8 checkpoint (`trnrt make-tiny --fp8`): its layout, loading it (weights stay FP8),
its accuracy against the bf16 model it was quantized from, and refusals of bad FP8 input.

transformers 5.23 cannot load this layout on a CPU-only box without `accelerate` (which the
project does not install) and, given it, only dequantizes to bf16 at load (FineGrainedFP8 needs a
GPU or XPU for FP8 compute), so the reference here is trnrt's own dequantize-then-bf16 model.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_helpers import Driver, tokens
from trnrt.models.glm5_next.config import ConfigError
from trnrt.models.glm5_next.fp8 import blocks
from trnrt.models.glm5_next.fp8.load import weight_bytes
from trnrt.models.glm5_next.fp8.modules import Fp8Experts, Fp8Linear
from trnrt.models.glm5_next.loading import load_model
from trnrt.models.glm5_next.weights import CheckpointError

P, N, PROMPTS = 16, 32, 8  # 8 prompts x 32 greedy tokens = 256 positions


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from trnrt.models.tiny import write_tiny_checkpoint
    from trnrt.models.tiny.fp8 import write_tiny_fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    return write_tiny_checkpoint(root / "bf16"), write_tiny_fp8_checkpoint(root / "fp8")


@pytest.fixture(scope="module")
def models(dirs):
    bf16_dir, fp8_dir = dirs
    return load_model(bf16_dir, dtype=torch.bfloat16), load_model(fp8_dir, dtype=torch.bfloat16)


def _one_shot(model, seq: torch.Tensor) -> torch.Tensor:
    d = Driver(model, max_blocks=8)
    d.new_seq("x")
    return d.step([("x", seq.tolist())], all_logits=True).logits[0, P - 1: P + N - 1].float()  # [N, V]


def _greedy(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    d = Driver(model, max_blocks=8)
    for i in range(len(prompts)):
        d.new_seq(i)
    out = [d.step([(i, p.tolist()) for i, p in enumerate(prompts)]).logits.argmax(-1)]
    for _ in range(N - 1):
        out.append(d.step([(i, [int(out[-1][i])]) for i in range(len(prompts))]).logits.argmax(-1))
    return torch.stack(out, 1)  # [PROMPTS, N]


def test_layout_is_the_release_layout(dirs):
    _, fp8_dir = dirs
    cfg = json.loads((fp8_dir / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    sd = load_file(str(fp8_dir / "model.safetensors"))
    fp8 = {k for k, t in sd.items() if t.dtype == torch.float8_e4m3fn}
    assert "model.language_model.layers.1.mlp.experts.7.up_proj.weight" in fp8  # per-expert names
    assert "model.language_model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in fp8
    assert "model.language_model.layers.6.eh_proj.weight" in fp8  # the MTP layer's
    for k in fp8:
        s = sd[k + "_scale_inv"]
        assert s.dtype == torch.float32 and tuple(s.shape) == blocks.scale_grid(tuple(sd[k].shape), (128, 128))
    for k in ("lm_head.weight", "model.language_model.embed_tokens.weight",
              "model.language_model.layers.1.mlp.gate.weight", "model.language_model.norm.weight",
              "model.language_model.layers.1.self_attn.indexer.weights_proj.weight"):
        assert sd[k].dtype == torch.bfloat16, k
    assert not any(k.endswith("_scale_inv") and k[: -len("_scale_inv")] not in fp8 for k in sd)


def test_loads_with_weights_in_fp8(models):
    ref, m = models
    assert isinstance(m.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(m.layers[1].mlp.experts, Fp8Experts)
    assert m.layers[1].mlp.gate.weight.dtype == torch.bfloat16  # the router stays bf16
    assert m.layers[1].self_attn.kv_b_proj.qweight.dtype == torch.float8_e4m3fn
    assert not any(isinstance(x, (Fp8Linear, Fp8Experts)) for x in ref.modules())  # default model untouched
    b8, b16 = weight_bytes(m), weight_bytes(ref)
    assert b8["float8_e4m3fn"] > 0 and "float8_e4m3fn" not in b16
    assert sum(b8.values()) < sum(b16.values())


def test_fp8_is_its_dequantized_bf16_model(dirs, models, tmp_path, report):
    """The FP8 graph computes exactly the model whose weights are the dequantized FP8 weights."""
    _, fp8_dir = dirs
    ref_dir = tmp_path / "dequant"
    shutil.copytree(fp8_dir, ref_dir)
    sd = load_file(str(ref_dir / "model.safetensors"))
    out = {k: (blocks.dequantize(t, sd[k + "_scale_inv"], (128, 128), torch.bfloat16) if t.dtype == torch.float8_e4m3fn
               else t) for k, t in sd.items() if not k.endswith("_scale_inv")}
    save_file(out, str(ref_dir / "model.safetensors"))
    cfg = json.loads((ref_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    deq = load_model(ref_dir, dtype=torch.bfloat16)
    seq = tokens(7, P + N)
    a, b = _one_shot(models[1], seq), _one_shot(deq, seq)
    report["fp8 vs dequantize-then-bf16: max |dlogit|"] = float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 2e-2  # bf16 rounding of fused vs unfused projections only
    # decode steps (Fp8Experts.gathered: the chosen experts' FP8 weights gathered, then dequantized)
    dec = []
    for model in (models[1], deq):
        d = Driver(model, max_blocks=8)
        d.new_seq("x")
        d.step([("x", seq[:P].tolist())])
        dec.append(torch.stack([d.step([("x", [int(t)])]).logits[0].float() for t in seq[P:P + 8]]))
    report["fp8 vs dequantize-then-bf16 decode: max |dlogit|"] = float((dec[0] - dec[1]).abs().max())
    assert torch.equal(dec[0].argmax(-1), dec[1].argmax(-1))
    assert (dec[0] - dec[1]).abs().max() < 2e-2


TRAIN_STEPS = 60  # `trnrt make-tiny --train-steps 60`: ~20 s on one thread


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny model trained TRAIN_STEPS steps on its corpus (bf16 checkpoint) and the FP8
    checkpoint quantized from exactly it (what `make-tiny --fp8 --train-steps` writes: the bf16
    checkpoint, then convert_dir), loaded in bf16."""
    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("fp8-trained")
    bf16_dir = write_tiny_checkpoint(root / "bf16", train_steps=TRAIN_STEPS)
    fp8_dir = root / "fp8"
    shutil.copytree(bf16_dir, fp8_dir)
    convert_dir(fp8_dir)
    return load_model(bf16_dir, dtype=torch.bfloat16), load_model(fp8_dir, dtype=torch.bfloat16)


def _agreement(ref, m, prompts: list[torch.Tensor]) -> tuple[float, float, float]:
    """(greedy agreement, agreement where the bf16 top-2 gap > 0.1, mean |dlogprob| of the greedy
    token) of `m` against `ref` over N greedy tokens of each prompt: the bf16 model's greedy
    continuations, teacher-forced through both."""
    gen = _greedy(ref, prompts)  # [PROMPTS, N] the bf16 model's greedy continuations
    agree = clear = clear_agree = 0
    dlp = []
    for i in range(len(prompts)):
        seq = torch.cat([prompts[i], gen[i]])
        lr, l8 = _one_shot(ref, seq), _one_shot(m, seq)  # [N, V] teacher-forced on the same tokens
        same = lr.argmax(-1) == l8.argmax(-1)
        agree += int(same.sum())
        top = lr.topk(2, -1).values
        ok = (top[:, 0] - top[:, 1]) > 0.1  # positions whose bf16 top-2 gap exceeds the FP8 noise
        clear += int(ok.sum())
        clear_agree += int(same[ok].sum())
        pick = gen[i][:, None]
        dlp.append((lr.log_softmax(-1).gather(-1, pick) - l8.log_softmax(-1).gather(-1, pick)).abs().mean())
    total = len(prompts) * N
    return agree / total, clear_agree / max(clear, 1), float(torch.stack(dlp).mean())


def test_greedy_agreement_with_the_bf16_model(trained, report):
    """Issue #32's criterion, on a model that has favourites: the tiny model trained briefly on
    its corpus, 8 corpus prompts x 32 greedy tokens = 256 positions, FP8 vs the bf16 model it was
    quantized from: >= 95 % greedy agreement. (Measured at 60 steps: ~97 %, mean |dlogprob| ~0.03.)"""
    from trnrt.models.tiny.tokenizer import build_tokenizer
    from trnrt.models.tiny.train import corpus_ids

    ids = corpus_ids(build_tokenizer())
    prompts = [torch.tensor(ids[300 * i + 7: 300 * i + 7 + P]) for i in range(PROMPTS)]
    agree, clear, dlp = _agreement(*trained, prompts)
    report["trained tiny: fp8 vs bf16 greedy agreement (256 positions)"] = agree
    report["trained tiny: fp8 vs bf16 mean |dlogprob| of the greedy token"] = dlp
    assert agree >= 0.95, agree
    assert dlp < 0.1, dlp


def test_greedy_agreement_on_the_random_model(models, report):
    """The random tiny model is flat (its own bf16 model matches its fp32 argmax on only ~97 %):
    ~20 % of positions have top-2 logits within 0.05, where FP8's ~2.6 % weight error flips the
    argmax. Reported, and >= 95 % required only where the bf16 top-2 gap is clear (> 0.1)."""
    prompts = [tokens(100 + i, P) for i in range(PROMPTS)]
    agree, clear, dlp = _agreement(*models, prompts)
    report["random tiny: fp8 vs bf16 greedy agreement (256 positions)"] = agree
    report["random tiny: fp8 vs bf16 agreement where the bf16 top-2 gap > 0.1"] = clear
    report["random tiny: fp8 vs bf16 mean |dlogprob| of the greedy token"] = dlp
    assert agree >= 0.85 and clear >= 0.95, (agree, clear)
    assert dlp < 0.1


def test_online_quantization_matches_the_fp8_checkpoint(dirs, models):
    """`--quantization fp8` on the fp32 tiny checkpoint quantizes the same weights the same way."""
    bf16_dir, _ = dirs
    online = load_model(bf16_dir, dtype=torch.bfloat16, quantization="fp8")
    a, b = dict(online.named_parameters()), dict(models[1].named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float()), k
    with pytest.raises(ConfigError, match="quantization"):
        load_model(bf16_dir, quantization="int4")


def _broken(fp8_dir, tmp_path, edit_sd=None, edit_cfg=None):
    d = tmp_path / "broken"
    shutil.copytree(fp8_dir, d)
    if edit_sd:
        sd = load_file(str(d / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(d / "model.safetensors"))
    if edit_cfg:
        cfg = json.loads((d / "config.json").read_text())
        edit_cfg(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_bad_fp8_input_is_refused_naming_it(dirs, tmp_path):
    _, fp8_dir = dirs
    w = "model.language_model.layers.4.self_attn.kv_b_proj.weight"
    with pytest.raises(CheckpointError) as e:  # a missing scale tensor
        load_model(_broken(fp8_dir, tmp_path / "a", edit_sd=lambda sd: sd.pop(w + "_scale_inv")))
    assert e.value.tensor == w + "_scale_inv" and "no block scale" in str(e.value)
    with pytest.raises(CheckpointError) as e:  # a scale without its weight
        load_model(_broken(fp8_dir, tmp_path / "b", edit_sd=lambda sd: sd.pop(w)))
    assert e.value.tensor == w + "_scale_inv"
    # a block size that does not fit the weights: [64, 64] on [128, 128] blocks (the dense
    # MLP's [128, 64] gate_proj has 1 x 1 scales, [64, 64] blocks need 2 x 1)
    with pytest.raises(CheckpointError) as e:
        load_model(_broken(fp8_dir, tmp_path / "c", edit_cfg=lambda q: q.update(weight_block_size=[64, 64])))
    assert e.value.tensor.endswith("_proj.weight_scale_inv") and "weight_block_size [64, 64]" in str(e.value)
    with pytest.raises(ConfigError) as e:  # an unknown quant_method
        load_model(_broken(fp8_dir, tmp_path / "d", edit_cfg=lambda q: q.update(quant_method="awq")))
    assert e.value.field == "quantization_config.quant_method" and "'awq'" in str(e.value)


def test_the_fp8_checkpoint_serves(dirs, models):
    """trnrt.LLM over the FP8 directory (detected from config.json): greedy tokens as the FP8
    model's own greedy decode gives them."""
    from trnrt.engine.core.llm import LLM
    from trnrt.engine.request import SamplingParams

    _, fp8_dir = dirs
    prompt = tokens(3, P).tolist()
    with LLM(str(fp8_dir), preset="default") as llm:
        res = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]
        assert llm.engine.runner.model.layers[0].self_attn.q_proj.qweight.dtype == torch.float8_e4m3fn
    assert res.error is None and len(res.output_ids) == 8
    m32 = load_model(fp8_dir)  # the default preset runs float32
    assert res.output_ids == _greedy_one(m32, torch.tensor(prompt), 8)
    with LLM(str(fp8_dir), preset="default", kv_cache_dtype="fp8_e4m3") as llm:  # and with an FP8 KV cache
        res = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]
        assert llm.engine.runner.state.latent.dtype == torch.float8_e4m3fn
    assert res.error is None and len(res.output_ids) == 8


def _greedy_one(model, prompt: torch.Tensor, n: int) -> list[int]:
    d = Driver(model, max_blocks=8)
    d.new_seq("x")
    out = [int(d.step([("x", prompt.tolist())]).logits[0].argmax())]
    for _ in range(n - 1):
        out.append(int(d.step([("x", [out[-1]])]).logits[0].argmax()))
    return out
