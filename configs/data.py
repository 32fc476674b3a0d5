"""The data sections: [data] (the training stream) and [eval] (the held-out one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import NO_EVAL, F


@dataclass
class DataConfig:
    source: str = F(
        "synthetic",
        "synthetic (seeded Markov source) | files (local jsonl/parquet/text by glob) | "
        "hf (an HF dataset, streamed)",
    )
    path: Optional[str] = F(
        None, "files: glob of local files, e.g. 'corpus/*.jsonl' (in a recipe file: relative to that file)"
    )
    format: Optional[str] = F(None, "files: json | parquet | text; None = from the files' extension")
    text_sample_by: str = F(
        "document", "files of plain text: a record is a document (file) | paragraph | line"
    )
    hf_dataset: Optional[str] = F(None, "hf: dataset name on the hub (or a local dataset folder), streamed")
    hf_config: Optional[str] = F(None, "hf: the dataset's config (subset) name, e.g. sample-10BT")
    split: str = F("train", "hf: the split to train on")
    text_column: str = F("text", "files/hf: the records' field holding the document's text")
    tokenizer: str = F(
        "byte", "byte (UTF-8 + BOS/EOS, 258 tokens) | an HF tokenizer folder or tokenizer.json | a hub id"
    )
    shuffle_windows: int = F(
        0, "files/hf: shuffle windows within blocks of this many (seeded by data.seed); 0 = off"
    )
    markov_branching: int = F(4, "synthetic: successors per token (lower = easier, lower floor)")
    seed: int = F(
        1234,
        "seed of the data stream (independent of the model seed): the synthetic source, or the "
        "files/hf window shuffle (unread with shuffle_windows = 0: the stream's own order)",
    )


@dataclass
class EvalConfig:
    every: int = F(0, "evaluate every N steps and after the last one; 0 = no evaluation")
    batches: int = F(4, "global batches per evaluation (the same held-out ones every time)" + NO_EVAL)
    path: Optional[str] = F(
        None, "data.source=files: held-out files (a glob), never the training files" + NO_EVAL
    )
    split: Optional[str] = F(None, "data.source=hf: the held-out split, e.g. 'validation'" + NO_EVAL)
