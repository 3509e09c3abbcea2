#!/usr/bin/env python
"""Train the bundled model's sentencepiece tokenizer and pack the corpus into token ids.

Trains a Llama-style sentencepiece BPE model (Touvron et al. 2023: BPE, byte fallback,
split digits, identity normalization so whitespace and newlines survive a round trip) on
``<corpus>/train.txt`` (see scripts/build_corpus.py) and writes:

    <out>/tokenizer.model           sentencepiece model, vocab 4096: <unk>=0, <s>=1, </s>=2,
                                    no pad piece (pad_id -1, as Llama's), 256 byte pieces
    <out>/tokenizer_config.json     Hugging Face-style: add_bos_token, special tokens, and a
                                    plain-text chat template (the model is not instruction-tuned)
    <out>/generation_config.json    bos/eos ids
    <corpus>/train_ids.npy          uint16 [N] token stream: for each document, <s> ids </s>
    <corpus>/valid_ids.npy          uint16 [M] the same for the held-out documents

Documents in the corpus text files are separated by a blank line; a document's inner
newlines are kept (they encode as the byte piece <0x0A>).

Usage: ``python scripts/train_tokenizer.py [--corpus data/corpus] [--out checkpoints/tiny-llama]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np
import sentencepiece as spm

# Rendered as plain text; "{{ bos_token }}" makes the rendered prompt start with <s>, so it is
# tokenized with add_special_tokens=False (the Hugging Face convention for templates that
# carry their own BOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] | trim }}\n\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] | trim }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train(corpus: str, out: str, vocab_size: int, model_type: str, threads: int) -> str:
    """Train the sentencepiece model; returns the path of ``tokenizer.model``."""
    os.makedirs(out, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=os.path.join(corpus, "train.txt"),
        model_writer=model,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=0.99995,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=16384,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=threads,
        minloglevel=1,
    )
    path = os.path.join(out, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def write_configs(sp: spm.SentencePieceProcessor, out: str, max_len: int) -> None:
    """tokenizer_config.json and generation_config.json in Hugging Face's layout."""
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": sp.id_to_piece(sp.bos_id()),
        "eos_token": sp.id_to_piece(sp.eos_id()),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "pad_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    gen_cfg = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}
    for name, obj in (("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")


def pack(sp: spm.SentencePieceProcessor, text_path: str, ids_path: str, threads: int) -> int:
    """Tokenize the documents of ``text_path`` to one uint16 stream; returns its length."""
    with open(text_path, encoding="utf-8") as f:
        docs = [d.rstrip("\n") for d in f.read().split("\n\n")]
    docs = [d for d in docs if d]
    encoded = sp.encode(docs, num_threads=threads)
    if sp.get_piece_size() > np.iinfo(np.uint16).max + 1:
        raise SystemExit("vocab does not fit uint16")
    stream = np.fromiter(
        (t for ids in encoded for t in (sp.bos_id(), *ids, sp.eos_id())), dtype=np.uint16
    )
    np.save(ids_path, stream)
    return int(stream.size)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--out", default="checkpoints/tiny-llama")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    ap.add_argument("--max-len", type=int, default=1024, help="model_max_length to record")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    path = train(args.corpus, args.out, args.vocab_size, args.model_type, args.threads)
    sp = spm.SentencePieceProcessor(model_file=path)
    write_configs(sp, args.out, args.max_len)
    stats = {"tokenizer": path, "vocab_size": sp.get_piece_size()}
    for split in ("train", "valid"):
        n = pack(
            sp,
            os.path.join(args.corpus, f"{split}.txt"),
            os.path.join(args.corpus, f"{split}_ids.npy"),
            args.threads,
        )
        chars = os.path.getsize(os.path.join(args.corpus, f"{split}.txt"))
        stats[f"{split}_tokens"] = n
        stats[f"{split}_bytes_per_token"] = round(chars / n, 3)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
