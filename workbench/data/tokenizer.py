"""Tokenizers: one small wrapper over Hugging Face ``tokenizers`` for every spec the workbench accepts.

Specs:

- ``"demo"``: the byte-level BPE trained on the embedded corpus (``workbench/data/corpus/demo-tokenizer``).
- a local Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``, or any
  directory ``transformers.AutoTokenizer`` can load offline as a *fast* tokenizer);
- a ``tokenizer.json`` file;
- ``"demo-wordpiece"``: the lower-cased WordPiece vocabulary trained on the embedded corpus for BERT
  (``workbench/data/corpus/demo-wordpiece``; ``[PAD]`` = 0, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]``);
- a WordPiece ``vocab.txt`` (BERT's format; a directory holding only ``vocab.txt`` too), read with
  BERT's normaliser and pre-tokenizer (lower-cased unless its ``tokenizer_config.json`` says
  ``do_lower_case: false``);
- a SentencePiece model file (``*.model``; a directory holding only ``spiece.model`` too), read as T5's
  tokenizer: its pieces plus the 100 sentinels ``<extra_id_0>`` ... ``<extra_id_99>``, ``</s>`` as
  end of sequence and ``<pad>`` as padding -- what transformers' ``T5TokenizerFast`` makes of it (converted
  to a fast tokenizer with ``sentencepiece`` and ``protobuf``, offline).

Nothing is downloaded: a hub name such as ``gpt2`` is refused with the fix (save it to a local
directory first).  The wrapper exposes what megatron-core's datasets need (``eod``, ``pad``,
``vocab_size``, ``unique_identifiers`` for the index cache key) and ``save(dir)`` writes files an
``AutoTokenizer`` loads, for checkpoint export.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from workbench.data.errors import DataError

__all__ = ["Tokenizer", "load_tokenizer", "tokenizer_spec", "resolve_tokenizer", "tokenizer_size", "decode_visible", "special_ids", "train_tokenizer", "train_wordpiece", "DEMO_TOKENIZER_DIR", "DEMO_WORDPIECE_DIR",
           "EOD_CANDIDATES", "WORDPIECE_SPECIALS"]

DEMO_TOKENIZER_DIR = Path(__file__).parent / "corpus" / "demo-tokenizer"
DEMO_WORDPIECE_DIR = Path(__file__).parent / "corpus" / "demo-wordpiece"
#: BERT's special tokens, in the order a trained WordPiece vocabulary gets them ([PAD] = 0)
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: end-of-document tokens recognised when a tokenizer config names no eos_token (first match wins)
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
DEFAULT_SPECIALS = ("<|endoftext|>", "<pad>")


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A fast tokenizer plus the special ids Megatron needs. Picklable (for worker processes)."""

    def __init__(self, backend: Any, name: str, eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None):
        self.backend = backend
        self.name = name
        vocab = backend.get_vocab(with_added_tokens=True)
        eos_token = eos_token or next((t for t in EOD_CANDIDATES if t in vocab), None)
        pad_token = pad_token or next((t for t in PAD_CANDIDATES if t in vocab), None)
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token or eos_token, pad_token
        self._eod = vocab.get(eos_token) if eos_token else None
        self.bos = vocab.get(self.bos_token) if self.bos_token else None
        self.pad = vocab.get(pad_token) if pad_token else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # -- what megatron-core's datasets read
    @property
    def eod(self) -> int:
        if self._eod is None:
            raise DataError(self.name, f"tokenizer has no end-of-document token (looked for {', '.join(EOD_CANDIDATES)})",
                            "set eos_token in its tokenizer_config.json")
        return self._eod

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def has_eod(self) -> bool:
        return self._eod is not None

    @property
    def unique_identifiers(self) -> dict:
        """Cache key for megatron-core's dataset indices: changes when the vocabulary changes."""
        digest = hashlib.md5(self.backend.to_str().encode("utf-8"), usedforsecurity=False).hexdigest()
        return {"class": "workbench.data.tokenizer.Tokenizer", "name": self.name, "vocab_size": self.vocab_size,
                "eod": self._eod, "sha": digest[:16]}

    # -- encode / decode
    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def spec(self) -> dict:
        """What a checkpoint records about its tokenizer."""
        return {"name": self.name, "vocab_size": self.vocab_size, "eod": self._eod, "bos": self.bos, "pad": self.pad,
                "eos_token": self.eos_token, "pad_token": self.pad_token, "sha": self.unique_identifiers["sha"]}

    # -- export
    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ special tokens map) for ``AutoTokenizer``."""
        from transformers import PreTrainedTokenizerFast

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        kwargs = {k: v for k, v in (("eos_token", self.eos_token), ("bos_token", self.bos_token),
                                    ("pad_token", self.pad_token)) if v}
        vocab = self.backend.get_vocab(with_added_tokens=True)
        # BERT's roles and <unk>, where the vocabulary has them (fill-mask pipelines need mask_token); T5's
        # sentinels are special added tokens of tokenizer.json already
        for role, names in (("unk_token", ("[UNK]", "<unk>")), ("cls_token", ("[CLS]",)), ("sep_token", ("[SEP]",)),
                            ("mask_token", ("[MASK]",))):
            name = next((n for n in names if n in vocab), None)
            if name:
                kwargs[role] = name
        hf = PreTrainedTokenizerFast(tokenizer_object=self.backend, **kwargs)
        hf.save_pretrained(str(directory))
        # transformers 5 writes its own class name; the 4.x name loads in both (pyproject allows >= 4.45).
        cfg_file = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        return directory

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["backend"] = self.backend.to_str()
        return state

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer as _Backend

        state = dict(state)
        state["backend"] = _Backend.from_str(state["backend"])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eod={self._eod}, pad={self.pad})"


def _read_tokenizer_config(directory: Path) -> dict:
    cfg: dict = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        f = directory / fname
        if f.is_file():
            try:
                cfg.update(json.loads(f.read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise DataError(str(f), f"not valid JSON ({e})", "repair or delete the file") from None
    return cfg


def _from_tokenizer_json(path: Path, name: str) -> Tokenizer:
    from tokenizers import Tokenizer as _Backend

    try:
        backend = _Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception with the serde message
        raise DataError(str(path), f"not a valid tokenizer.json ({e})", "point at a tokenizer.json written by Hugging Face tokenizers") from None
    cfg = _read_tokenizer_config(path.parent)
    return Tokenizer(backend, name, eos_token=_token_content(cfg.get("eos_token")),
                     bos_token=_token_content(cfg.get("bos_token")), pad_token=_token_content(cfg.get("pad_token")))


def _wordpiece_backend(vocab: Path, lowercase: bool) -> Any:
    from tokenizers import Tokenizer as _Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    try:
        model = models.WordPiece.from_file(str(vocab), unk_token="[UNK]")
    except Exception as e:
        raise DataError(str(vocab), f"not a WordPiece vocab.txt ({e})", "give BERT's vocab.txt: one token per line") from None
    backend = _Backend(model)
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    specials = [t for t in WORDPIECE_SPECIALS if backend.token_to_id(t) is not None]
    backend.add_special_tokens(specials)
    return backend


def _from_vocab_txt(vocab: Path, name: str) -> Tokenizer:
    """A BERT WordPiece tokenizer from ``vocab.txt`` (lower-cased unless tokenizer_config.json says otherwise)."""
    cfg = _read_tokenizer_config(vocab.parent)
    backend = _wordpiece_backend(vocab, bool(cfg.get("do_lower_case", True)))
    return Tokenizer(backend, name, eos_token="[SEP]" if backend.token_to_id("[SEP]") is not None else None,
                     pad_token="[PAD]" if backend.token_to_id("[PAD]") is not None else None)


def _demo_t5() -> Tokenizer:
    """``demo-t5``: the demo byte-level BPE (trained on the embedded corpus) with T5's 100 sentinels
    ``<extra_id_0>`` ... ``<extra_id_99>`` appended as special tokens (ids 4096-4195; vocab 4196)."""
    from tokenizers import AddedToken

    f = DEMO_TOKENIZER_DIR / "tokenizer.json"
    if not f.is_file():
        raise DataError(str(f), "the demo tokenizer is missing from this install", "reinstall the workbench (pip install -e .)")
    base = _from_tokenizer_json(f, "demo-t5")
    base.backend.add_special_tokens([AddedToken(f"<extra_id_{i}>", special=True, normalized=False, lstrip=True) for i in range(100)])
    return Tokenizer(base.backend, "demo-t5", eos_token=base.eos_token, bos_token=base.bos_token, pad_token=base.pad_token)


def _from_sentencepiece(model: Path, name: str) -> Tokenizer:
    """A SentencePiece ``.model`` as T5's tokenizer (see module docstring)."""
    import shutil
    import tempfile

    try:
        import google.protobuf  # noqa: F401  (transformers' converter parses the model with it)
        import sentencepiece  # noqa: F401
        from transformers import T5TokenizerFast  # the fast class in transformers 4.x and 5.x alike
    except ImportError as e:
        raise DataError(str(model), f"reading a SentencePiece model needs the '{e.name}' package",
                        "pip install sentencepiece protobuf (both are workbench dependencies: re-run bash launch/setup.sh)") from None
    with tempfile.TemporaryDirectory(prefix="workbench-spm-") as d:
        shutil.copyfile(model, Path(d) / "spiece.model")  # the name T5's tokenizer looks for
        try:
            hf = T5TokenizerFast.from_pretrained(d, local_files_only=True, extra_ids=100)
        except Exception as e:
            raise DataError(str(model), f"not a SentencePiece model transformers can read ({type(e).__name__}: {e})",
                            "give the .model file SentencePiece's trainer wrote (e.g. HF T5's spiece.model)") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.get_vocab_size(with_added_tokens=False) <= 1:
        raise DataError(str(model), "the SentencePiece model converted to an empty vocabulary",
                        "give the .model file SentencePiece's trainer wrote (e.g. HF T5's spiece.model)")
    return Tokenizer(backend, name, eos_token=hf.eos_token, bos_token=hf.bos_token, pad_token=hf.pad_token)


def load_tokenizer(spec: "str | Path | Tokenizer") -> Tokenizer:
    """Resolve a tokenizer spec (see module docstring); a clear :class:`DataError` for anything else."""
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or str(spec).strip() == "":
        raise DataError("tokenizer", "no tokenizer given", "use 'demo', a local tokenizer directory or a tokenizer.json")
    text = str(spec)
    if text == "demo":
        f = DEMO_TOKENIZER_DIR / "tokenizer.json"
        if not f.is_file():
            raise DataError(str(f), "the demo tokenizer is missing from this install", "reinstall the workbench (pip install -e .)")
        return _from_tokenizer_json(f, "demo")
    if text == "demo-wordpiece":
        f = DEMO_WORDPIECE_DIR / "tokenizer.json"
        if not f.is_file():
            raise DataError(str(f), "the demo WordPiece tokenizer is missing from this install", "reinstall the workbench (pip install -e .)")
        return _from_tokenizer_json(f, "demo-wordpiece")
    if text == "demo-t5":
        return _demo_t5()
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".txt":
            return _from_vocab_txt(path, str(path))
        if path.suffix == ".model":
            return _from_sentencepiece(path, str(path))
        return _from_tokenizer_json(path, str(path))
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_tokenizer_json(path / "tokenizer.json", str(path))
        if (path / "vocab.txt").is_file() and not (path / "vocab.json").is_file():
            return _from_vocab_txt(path / "vocab.txt", str(path))
        if (path / "spiece.model").is_file() and not (path / "tokenizer_config.json").is_file():
            return _from_sentencepiece(path / "spiece.model", str(path))
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
        except Exception as e:
            raise DataError(str(path), f"no tokenizer could be loaded from this directory ({type(e).__name__}: {e})",
                            "give a directory with tokenizer.json (or vocab.json + merges.txt)") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise DataError(str(path), "only fast (Rust) tokenizers are supported", "convert it with transformers and save tokenizer.json")
        return Tokenizer(backend, str(path), eos_token=hf.eos_token, bos_token=hf.bos_token, pad_token=hf.pad_token)
    hint = ("nothing is downloaded: save the tokenizer to a local directory first "
            "(e.g. AutoTokenizer.from_pretrained(name).save_pretrained(DIR)) and pass DIR")
    if "/" not in text and not text.endswith(".json"):
        raise DataError(text, "not 'demo' and not a local tokenizer path", hint)
    raise DataError(text, "tokenizer path does not exist", hint)


def tokenizer_spec(info: Any) -> Any:
    """Where the tokenizer of a checkpoint (``info``: a :class:`workbench.checkpoint.CheckpointInfo`) lives:
    files next to the weights, the recorded spec, the run's data.tokenizer (None: it records none).  A recorded relative path is as the run wrote it (relative to where it was launched)."""
    for d in (info.path, info.path.parent, info.path.parent / "tokenizer"):  # conversion ships ROOT/tokenizer/
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return str(d)
    spec = info.meta.get("tokenizer")
    if isinstance(spec, dict):
        spec = spec.get("path") or spec.get("name")
    if spec:
        return spec
    return info.config.data.tokenizer or None


def resolve_tokenizer(info: Any) -> "Tokenizer | None":
    """The tokenizer of a checkpoint (``info``: a :class:`workbench.checkpoint.CheckpointInfo`), or None when it
    records none."""
    spec = tokenizer_spec(info)
    if spec is None:
        return None
    return load_tokenizer(spec)


def tokenizer_size(tok: Any) -> int | None:
    """How many ids a workbench or HF tokenizer can decode (None when unknown)."""
    if tok is None:
        return None
    try:
        return int(tok.vocab_size) if hasattr(tok, "has_eod") else len(tok)
    except (TypeError, AttributeError):
        return getattr(tok, "vocab_size", None)


def decode_visible(tok: Any, ids: list[int]) -> str:
    """Text of ``ids``; an id the tokenizer has no token for shows as ``<id:N>``, never as nothing
    (a model whose vocabulary is larger than its tokenizer's would otherwise print empty text)."""
    n = tokenizer_size(tok)
    if n is None or all(i < n for i in ids):
        return tok.decode(ids)
    out: list[str] = []
    run: list[int] = []
    for i in ids:
        if i < n:
            run.append(i)
            continue
        if run:
            out.append(tok.decode(run))
            run = []
        out.append(f"<id:{i}>")
    if run:
        out.append(tok.decode(run))
    return "".join(out)


def special_ids(tok: Any) -> dict[str, int | None]:
    """EOS / BOS / PAD ids of a workbench or HF tokenizer (None when absent)."""
    if tok is None:
        return {"eos": None, "bos": None, "pad": None}
    if hasattr(tok, "has_eod"):  # workbench.data.tokenizer.Tokenizer
        eos = tok.eod if tok.has_eod else None
        return {"eos": eos, "bos": tok.bos, "pad": tok.pad}
    return {"eos": getattr(tok, "eos_token_id", None), "bos": getattr(tok, "bos_token_id", None),
            "pad": getattr(tok, "pad_token_id", None)}


def train_tokenizer(inputs: "Iterable[str] | Iterator[str]", vocab_size: int, out_dir: str | Path | None = None,
                    min_frequency: int = 2, special_tokens: tuple[str, ...] = DEFAULT_SPECIALS,
                    name: str | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style, no unknown tokens) on an iterator of documents.

    Special tokens come first (``<|endoftext|>`` = id 0 is the end-of-document token, ``<pad>`` = 1).
    """
    from tokenizers import Tokenizer as _Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens) + 1:
        raise DataError("--vocab-size", f"{vocab_size} is too small for a byte-level BPE", f"use at least {256 + len(special_tokens) + 1}")
    backend = _Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    backend.train_from_iterator(inputs, trainer=trainer)
    eos = special_tokens[0] if special_tokens else None
    pad = next((t for t in special_tokens if t in PAD_CANDIDATES), None)
    tok = Tokenizer(backend, name or (str(out_dir) if out_dir else "trained"), eos_token=eos, bos_token=eos, pad_token=pad)
    if out_dir is not None:
        tok.save(out_dir)
    return tok


def train_wordpiece(inputs: "Iterable[str] | Iterator[str]", vocab_size: int, out_dir: str | Path | None = None,
                    min_frequency: int = 2, lowercase: bool = True, name: str | None = None) -> Tokenizer:
    """Train a BERT WordPiece vocabulary (``##`` continuation pieces) on an iterator of documents, offline.

    BERT's normaliser (lower-cased by default) and pre-tokenizer; the special tokens come first:
    ``[PAD]`` = 0, ``[UNK]`` = 1, ``[CLS]`` = 2, ``[SEP]`` = 3, ``[MASK]`` = 4.  ``out_dir`` gets
    ``tokenizer.json``, ``tokenizer_config.json`` (with BERT's special-token names) and ``vocab.txt``.
    """
    from tokenizers import Tokenizer as _Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < len(WORDPIECE_SPECIALS) + 64:
        raise DataError("--vocab-size", f"{vocab_size} is too small for a WordPiece vocabulary", f"use at least {len(WORDPIECE_SPECIALS) + 64}")
    backend = _Backend(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(WORDPIECE_SPECIALS),
                                        continuing_subword_prefix="##", show_progress=False)
    backend.train_from_iterator(inputs, trainer=trainer)
    tok = Tokenizer(backend, name or (str(out_dir) if out_dir else "trained-wordpiece"), eos_token="[SEP]", pad_token="[PAD]")
    if out_dir is not None:
        out = tok.save(out_dir)
        cfg_file = out / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        cfg.update(cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]", pad_token="[PAD]",
                   do_lower_case=lowercase)
        cfg.pop("bos_token", None)
        cfg.pop("eos_token", None)
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        vocab = backend.get_vocab(with_added_tokens=True)
        (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])), encoding="utf-8")
    return tok
