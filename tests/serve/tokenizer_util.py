"""A small GLM-like HF tokenizer for serve tests (until the tiny model's tokenizer lands).

Byte-level BPE trained in-process on a few sentences (any text encodes), GLM's special tokens
added as special added tokens, and a GLM-4.7/5-style chat template (no newlines after role tokens,
`<|assistant|><think>` generation prompt, `</think>` when enable_thinking is false).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
]

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if reasoning_effort is defined and reasoning_effort %}<|system|>Reasoning Effort: {{ reasoning_effort }}{% endif -%}"
    "{%- if tools %}<|system|>\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value></tool_call>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' %}<|system|>{{ m.content }}"
    "{%- elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<|assistant|><think>{{ m.reasoning_content or '' }}</think>{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor -%}"
    "{%- elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- else %}{{ raise_exception('unknown role ' ~ m.role) }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking %}</think>{% else %}<think>{% endif %}{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. Paris is a city in France.",
    "Hello world! How are you today? I am fine, thank you.",
    "Let me think about the weather in Beijing and call a function.",
    "get_weather city date 2024-06-27 unit celsius fahrenheit days 3",
    '{"city": "Paris", "days": 3, "flag": true}',
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "北京 天气 你好 世界",
]


def write_test_tokenizer(path: Path) -> Path:
    """Write the tokenizer (tokenizer.json + tokenizer_config.json with the template) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
