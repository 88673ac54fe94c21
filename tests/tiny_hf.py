"""A real byte-level BPE tokenizer trained here on local text, and a tiny model directory saved
with ``save_pretrained``: what a user brings, built in a temporary folder (nothing downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "corpus.txt"


def train_tokenizer(out: Path, files: list[Path] | None = None, vocab_size: int = 400) -> int:
    """A byte-level BPE (``tokenizers``) saved as a HF tokenizer directory; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files or [TEXT]],
              trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    return len(fast)


def tiny_llama(out: Path, vocab_size: int, tokenizer: bool = True, layers: int = 4) -> Path:
    """A Llama-architecture model directory (random weights, ``save_pretrained``), with a tokenizer
    of ``vocab_size`` tokens trained on the repository's text when ``tokenizer``."""
    import transformers as T

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        vocab_size = max(vocab_size, train_tokenizer(out, vocab_size=vocab_size))
    cfg = T.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    return out
