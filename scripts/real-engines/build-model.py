"""Builds the tiny random-weight Llama model the real-engine suite serves, with no model hub.

The tokenizer is a byte-level BPE trained on this Python's own standard-library sources, wrapped as a
`PreTrainedTokenizerFast` with special tokens, a BOS-adding post-processor and a Jinja chat template,
and saved with `save_pretrained`: a real `tokenizer.json` and `tokenizer_config.json`, exactly what an
engine (and kvgate's HuggingFace tokenizer) reads. Current `transformers` writes the template to
`chat_template.jinja` beside them; a second copy of the tokenizer, in `tokenizer-inline/`, keeps it
inline as `chat_template` in `tokenizer_config.json`, the older layout. Routing does not care what the
weights mean, so they are random.

Usage: python build-model.py OUT_DIR TEMPLATE.jinja
"""

import json
import sys
import sysconfig
from pathlib import Path

VOCAB = 8192
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]


def corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")
    # A little of every script, so unicode text tokenizes into more than raw bytes.
    yield "naïve café résumé — “quotes” 東京 你好，世界 こんにちは 안녕하세요 Привет мир 🙂🚀 ñ ü ß"


def build_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS, PAD, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=CHAT_TOKENS,
        model_max_length=4096,
    )
    fast.chat_template = template
    return fast


def build_model(out: Path, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)


def main():
    out, template_path = Path(sys.argv[1]), Path(sys.argv[2])
    template = template_path.read_text(encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(template)
    tokenizer.save_pretrained(out)
    inline = out / "tokenizer-inline"
    tokenizer.save_pretrained(inline, save_jinja_files=False)
    build_model(out, tokenizer)
    config = json.loads((inline / "tokenizer_config.json").read_text())
    if config.get("chat_template") != template:
        sys.exit("build-model: tokenizer-inline/tokenizer_config.json does not carry the chat template inline")
    if not (out / "chat_template.jinja").exists():
        sys.exit("build-model: transformers did not write chat_template.jinja")
    print(f"build-model: {out} ({len(tokenizer)} tokens)")


if __name__ == "__main__":
    main()
