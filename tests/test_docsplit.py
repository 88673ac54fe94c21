"""A long document encoded in proven pieces has exactly the ids HF gives the whole document, for
every kind of tokenizer (byte-level BPE with GPT-2's and Qwen2's regexes, Metaspace with Unigram
and with byte-fallback BPE, WordPiece), and a tokenizer whose pipeline cannot be cut is encoded
whole and says so. The tokenizers are trained here on the repository's text (nothing downloaded)."""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from torchpp.data.docsplit import DocSplitter, unsplittable

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [ROOT / "tests" / "data" / "corpus.txt", ROOT / "torchpp" / "data" / "prepare.py",
         ROOT / "torchpp" / "data" / "tokenizer.py"]
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
BOUND, CONTEXT = 300, 64


def _texts() -> list[str]:
    """The training text in chunks that keep their newlines (``train`` on files reads line by line)."""
    text = "".join(f.read_text() for f in TRAIN)
    return [text[i:i + 4000] for i in range(0, len(text), 4000)]


def _bpe(pre, normalizer=None, specials=("<|endoftext|>",), **bpe):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(**bpe))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if "Byte" in json.dumps(json.loads(tok.to_str())) else []
    tok.train_from_iterator(_texts(), trainers.BpeTrainer(vocab_size=2000, special_tokens=list(specials),
                                                           initial_alphabet=alphabet, show_progress=False))
    return tok


def _gpt2():
    from tokenizers import pre_tokenizers

    return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))


def _roberta():
    from tokenizers import pre_tokenizers, processors

    tok = _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True), specials=("<s>", "</s>"))
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return tok


def _qwen2():
    from tokenizers import Regex, normalizers, pre_tokenizers

    return _bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                normalizers.NFC(), specials=("<|endoftext|>", "<|im_start|>"))


def _mistral(split=True):
    """Metaspace (prepend on the first piece) and a BPE that falls back to bytes."""
    from tokenizers import pre_tokenizers, processors

    tok = _bpe(pre_tokenizers.Metaspace(prepend_scheme="first", split=split), specials=("<unk>", "<s>", "</s>"),
               byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def _t5():
    """SentencePiece-like: NFKC, runs of spaces collapsed, Metaspace prepending to every piece, Unigram."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.train_from_iterator(_texts(), trainers.UnigramTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                                              unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return tok


def _bert():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(_texts(), trainers.WordPieceTrainer(vocab_size=500, special_tokens=[
        "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
        ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return tok


def _old_llama():
    """SentencePiece converted the old way: Prepend("▁") and no pre-tokenizer (cannot be cut)."""
    from tokenizers import normalizers

    return _bpe(None, normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                specials=("<unk>", "<s>"), byte_fallback=True, unk_token="<unk>")


KINDS = {"gpt2": _gpt2, "roberta": _roberta, "qwen2": _qwen2, "mistral": _mistral, "t5": _t5, "bert": _bert}


def _docs() -> dict[str, str]:
    rng = random.Random(0)
    code = "".join((ROOT / "torchpp" / "data" / f).read_text() for f in ("corpus.py", "sources.py", "cache.py"))
    prose = " ".join((ROOT / "tests" / "data" / "corpus.txt").read_text().split())
    spaces = "".join(rng.choice(["word", "x", "42", ".", "é", " " * rng.randint(1, 40), "\t" * rng.randint(1, 3),
                                 "\n" * rng.randint(1, 4), " \n  \n\t", "\r\n"]) for _ in range(5000))
    uni = "".join(rng.choice(["日本語のテキスト", "中文文本", "😀🚀", "e\u0301", "Ａｂｃ", "ﬁ", "مرحبا", "\n", " ", "\n  ",
                              "ä", "\u200b", "İ"]) for _ in range(4000))
    return {"code": code, "crlf": code.replace("\n", "\r\n"), "whitespace": spaces, "unicode": uni,
            "no_newline": prose[:30000], "added_token": code[:12000] + "<|endoftext|>" + code[12000:24000]}


@pytest.fixture(scope="module")
def docs() -> dict[str, str]:
    return _docs()


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_give_the_ids_of_the_whole_document(kind, docs):
    from transformers import PreTrainedTokenizerFast

    tok = KINDS[kind]()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    # HF's own backend, as prepare has it (a tokenizer fresh from training and its copy through JSON
    # can differ on a near-tie of Unigram scores)
    split = DocSplitter(hf.backend_tokenizer, bound=BOUND, context=CONTEXT)
    assert split.reason is None
    for name, text in docs.items():
        for special in (False, True):
            before = split.pieces
            got = split.ids(text, add_special_tokens=special)
            want = hf(text, add_special_tokens=special)["input_ids"]
            assert got.tolist() == want, (kind, name, special)
        cuts = list(split.cuts(text))
        assert all(b - a <= 4 * BOUND for a, b in zip(cuts[:-2], cuts[1:-1]))  # every piece but the last is bounded
    # the document was really cut where cuts exist: many pieces, not one whole encoding
    for name in ("code", "crlf", "whitespace", "unicode", "no_newline"):
        assert len(list(split.cuts(docs[name]))) > len(docs[name]) // (4 * BOUND), (kind, name)


def test_added_tokens_that_take_the_whitespace_beside_them_are_cut_by_their_ids(docs):
    """An added token is taken out before pre-tokenizing, and with lstrip/rstrip takes the
    whitespace beside it: cuts next to one are proven on the whole pipeline's ids."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = _gpt2()
    tok.add_tokens([AddedToken("<|sep|>", lstrip=True, rstrip=True)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "".join(f"x{i} = {i} <|sep|>\n    y = [{i}]  <|sep|>  \n\n" for i in range(400)) + docs["added_token"]
    split = DocSplitter(hf.backend_tokenizer, bound=BOUND, context=CONTEXT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = split.ids(text)
    assert got.tolist() == hf(text, add_special_tokens=False)["input_ids"]
    assert len(list(split.cuts(text))) > len(text) // (2 * BOUND)
    # cut where the pre-tokens alone allow it, the ids change: the whitespace belongs to the token
    split._holds_added = lambda window: False
    assert split.ids(text).tolist() != hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("make,reason", [(_old_llama, "Prepend"), (lambda: _mistral(split=False), "one pre-token")])
def test_a_tokenizer_that_cannot_be_cut_encodes_whole_and_says_so(make, reason, docs):
    tok = make()
    split = DocSplitter(tok, bound=BOUND, context=CONTEXT)
    assert reason in split.reason
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = split.ids(docs["code"])
        split.ids(docs["crlf"])
    assert got.tolist() == tok.encode(docs["code"], add_special_tokens=False).ids and split.pieces == 0
    assert len(said) == 1 and "encoded whole" in str(said[0].message) and reason in str(said[0].message)


def test_pipelines_that_cannot_be_checked_locally_are_refused():
    from tokenizers import Regex, pre_tokenizers

    tok = _gpt2()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+(?=\s*\w)"), behavior="isolated")
    assert "looks ahead" in unsplittable(tok)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(QWEN2), behavior="isolated")
    assert unsplittable(tok) is None
    tok.pre_tokenizer = None
    assert "no pre-tokenizer" in unsplittable(tok)
    tok.enable_truncation(64)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert "truncation" in DocSplitter(tok).reason


def test_prepare_cuts_a_long_document_and_keeps_its_ids(tmp_path, monkeypatch):
    import torchpp.data.docsplit as D
    from tiny_hf import train_tokenizer
    from torchpp.data import prepare_corpus
    from transformers import AutoTokenizer

    train_tokenizer(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    docs = _docs()
    rows = [docs["code"], "short one", docs["whitespace"], docs["unicode"]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    monkeypatch.setattr(D, "SPLIT_CHARS", BOUND)
    cut = []
    real = D.DocSplitter.ids
    monkeypatch.setattr(D.DocSplitter, "ids", lambda self, *a, **k: cut.append(1) or real(self, *a, **k))
    prepare_corpus([tmp_path / "in.jsonl"], tmp_path / "c", tokenizer=tmp_path / "tok", num_proc=1)
    want = [t for d in rows for t in hf(d, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]]
    assert np.fromfile(tmp_path / "c" / "tokens.bin", dtype="<u2").tolist() == want
    assert len(cut) == 3  # the three long documents went through the pieces


def test_a_long_text_file_is_read_in_pieces_recut_where_the_ids_do_not_change(tmp_path, monkeypatch):
    """Text files are read in ~PIECE_BYTES pieces cut after a newline; encoded apart, such pieces
    change the ids of indented text (a newline and the next line's indent are one pre-token)."""
    import torchpp.data.docsplit as D
    import torchpp.data.sources as S
    from torchpp.data import discover, prepare_corpus
    from transformers import PreTrainedTokenizerFast

    tok = _gpt2()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf.save_pretrained(str(tmp_path / "tok"))
    text = _docs()["code"] * 2
    (tmp_path / "big.py.txt").write_text(text)
    monkeypatch.setattr(S, "PIECE_BYTES", 2000)
    monkeypatch.setattr(D, "SPLIT_CHARS", BOUND)
    src = discover([tmp_path / "big.py.txt"]).sources[0]
    raw = (tmp_path / "big.py.txt").read_bytes()
    naive = [t for a, b in src.pieces for t in tok.encode(raw[a:b].decode(), add_special_tokens=False).ids]
    want = hf(text, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert len(src.pieces) > 10 and naive + [hf.eos_token_id] != want  # the pieces alone would change ids
    index = prepare_corpus([tmp_path / "big.py.txt"], tmp_path / "c", tokenizer=tmp_path / "tok", num_proc=2)
    assert index.documents == 1
    assert np.fromfile(tmp_path / "c" / "tokens.bin", dtype="<u2").tolist() == want
