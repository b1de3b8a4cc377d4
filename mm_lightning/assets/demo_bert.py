"""Writes the shipped demo text encoder (``mm-lightning/demo-bert``): a tiny BERT config and a WordPiece
vocabulary of the demo captions' words. When the demo captions change, call
``build_demo_bert(ASSETS_DIR / "demo-bert")``; runs read the shipped files."""

from __future__ import annotations

from pathlib import Path

from mm_lightning.data.demo import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, TEMPLATES


def demo_words() -> list[str]:
    """Every word the demo captions can contain, sorted (the demo tokenizer's vocabulary is built from it)."""
    words: set[str] = set()
    for template in TEMPLATES:
        words.update(w for w in template.replace("{", " {").split() if not w.startswith("{"))
    for group in (SHAPES, COLOURS, SIZES, POSITIONS, BACKGROUNDS):
        for name in group:
            words.update(name.split())
    return sorted(words)


def build_demo_bert(out_dir: str | Path) -> Path:
    """Write the demo text encoder directory: a tiny BERT ``config.json`` and a WordPiece tokenizer.

    The vocabulary is the demo captions' words (no ``[UNK]``); no weights (``pretrained: false``).
    """
    from transformers import BertConfig, BertTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", *demo_words()]
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, model_max_length=64)
    tokenizer.save_pretrained(out)
    BertConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
    ).save_pretrained(out)
    return out
