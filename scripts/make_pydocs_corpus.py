"""Make the text corpus `recipes/text_cpu.toml` trains on, from files every Python install has:
the Language Reference topics `help()` shows (pydoc_data) and the docstrings of the standard
library's public modules, classes and functions (PSF license). Writes jsonl shards (8 to train
on, 2 held out: a tenth, by a hash of each document's name) and a byte-level BPE tokenizer trained on the
training shards, with BOS/EOS named in tokenizer_config.json.

    python scripts/make_pydocs_corpus.py recipes/corpora/pydocs   # what is shipped (Python 3.11)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

SKIP = ("idlelib", "tkinter", "turtle", "turtledemo", "antigravity", "this", "test", "lib2to3", "ensurepip")


def documents() -> list[dict]:
    import pydoc_data.topics

    docs = {f"topic:{k}": v for k, v in pydoc_data.topics.topics.items()}
    warnings.simplefilter("ignore")
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name.startswith(SKIP):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        docs[f"module:{name}"] = inspect.getdoc(module) or ""
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) not in (name, f"_{name}"):
                continue
            if inspect.isclass(obj) or inspect.isroutine(obj):
                docs[f"{name}.{attr}"] = inspect.getdoc(obj) or ""
            if inspect.isclass(obj):  # its public methods' own docstrings
                for meth, fn in sorted(vars(obj).items()):
                    if not meth.startswith("_") and inspect.isroutine(fn) and fn.__doc__:
                        docs[f"{name}.{attr}.{meth}"] = inspect.cleandoc(fn.__doc__)
    return [{"id": k, "text": v.strip()} for k, v in sorted(docs.items()) if len(v.strip()) >= 200]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--vocab", type=int, default=2048)
    args = p.parse_args()
    docs = documents()
    shards: dict[str, list[dict]] = {}
    for d in docs:
        h = int(hashlib.sha256(d["id"].encode()).hexdigest(), 16)
        kind, n = ("heldout", 2) if h % 10 == 0 else ("train", 8)  # 10% held out
        shards.setdefault(f"{kind}/part{h // 20 % n}.jsonl", []).append(d)
    for rel, rows in sorted(shards.items()):
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    train_texts = [r["text"] for rel, rows in shards.items() if rel.startswith("train") for r in rows]
    tok.train_from_iterator(train_texts, trainer)
    (args.out / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(args.out / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1], "model_max_length": 4096}
    (args.out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    chars = sum(len(d["text"]) for d in docs)
    print(f"{len(docs)} documents, {chars / 1e6:.2f} M characters, vocab {tok.get_vocab_size()}: {args.out}")


if __name__ == "__main__":
    main()
