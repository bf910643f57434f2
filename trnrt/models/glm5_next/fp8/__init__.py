"""FP8 block-quantized weights for glm5_next (DeepSeek-V3 layout; `--quantization fp8`).

* `blocks`: quantize / dequantize per [128, 128] block (partial last blocks: ceil division);
* `qconfig`: config.json's `quantization_config` read and checked (QuantConfig);
* `policy`: which weights are FP8 when trnrt quantizes (online, `make-tiny --fp8`);
* `names`: checkpoint FP8 tensors -> the serving model's module paths;
* `modules`: Fp8Linear / Fp8Experts, swapped in only when FP8 is active (default graphs unchanged);
* `backend`: the one place that picks how an FP8 weight meets an activation;
* `load`: load_fp8_model (called by weights.load_model); `checkpoint`: write the FP8 layout.

Import the submodules directly; this file stays light (no torch).
"""
