"""Document corpora on small local files: each dp rank reads its own part (nothing twice,
nothing missing), documents carry BOS/EOS and pack into seq_len + 1 windows, blocks shuffle by
their seed, a position resumes with the next window exactly (and on another dp degree by
the documented rule), and bad input is an error naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshforge.configs import Recipe
from meshforge.core.errors import CheckpointError, DataError, DataNotFound
from meshforge.run.data.corpus import DocumentWindows, open_stream, windows_to_skip
from meshforge.run.data.loader import CorpusLoader, build_loader
from meshforge.run.data.tokenizer import ByteTokenizer, HFTokenizer

pytest.importorskip("datasets")

N_FILES, DOCS_PER_FILE = 4, 6


def doc_text(f: int, i: int) -> str:
    return f"<{f}.{i}>" + "abc " * (i + f)  # documents of different lengths


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jsonl")
    for f in range(N_FILES):
        rows = [{"id": f"{f}.{i}", "text": doc_text(f, i)} for i in range(DOCS_PER_FILE)]
        (root / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def recipe(data: dict, **train) -> object:
    r = Recipe()
    for k, v in data.items():
        setattr(r.data, k, v)
    r.train.seq_len, r.train.micro_batch_size, r.train.grad_accum_steps = 15, 2, 1
    for k, v in train.items():
        setattr(r.train, k, v)
    return r


def windows(r, dp_rank=0, dp_size=1) -> DocumentWindows:
    d = r.data
    stream = open_stream(d, d.split, dp_rank, dp_size)
    return DocumentWindows(
        stream, ByteTokenizer(), d.text_column, r.train.seq_len, d.shuffle_windows, d.seed, dp_rank
    )


def packed(texts: list[str], width: int) -> list[list[int]]:
    tok = ByteTokenizer()
    flat = [t for text in texts for t in tok.document(text)]
    return [flat[i : i + width] for i in range(0, len(flat) - width + 1, width)]


def test_dp_ranks_read_disjoint_parts_that_cover_the_corpus(jsonl):
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl")})
    parts = [[row["id"] for row in open_stream(r.data, "train", d, 2)] for d in range(2)]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(
        f"{f}.{i}" for f in range(N_FILES) for i in range(DOCS_PER_FILE)
    )
    assert parts[0][:DOCS_PER_FILE] == [f"0.{i}" for i in range(DOCS_PER_FILE)]  # whole files per rank


def test_documents_get_bos_and_eos_and_pack_into_windows_without_overlap(jsonl):
    r = recipe({"source": "files", "path": str(jsonl / "part0.jsonl")})
    got = windows(r).next_windows(8).tolist()
    want = packed([doc_text(0, i) for i in range(DOCS_PER_FILE)], r.train.seq_len + 1)
    assert len(want) == 6 and got == want + want[:2]  # then the next epoch, from the start
    assert got[0][0] == ByteTokenizer.bos_id and ByteTokenizer.eos_id in got[0]


def test_blocks_shuffle_by_their_own_seed(jsonl):
    base = {"source": "files", "path": str(jsonl / "*.jsonl")}
    plain = windows(recipe(base)).next_windows(12).tolist()
    shuffled = windows(recipe({**base, "shuffle_windows": 4})).next_windows(12).tolist()
    again = windows(recipe({**base, "shuffle_windows": 4})).next_windows(12).tolist()
    other = windows(recipe({**base, "shuffle_windows": 4, "seed": 7})).next_windows(12).tolist()
    assert shuffled == again and shuffled != plain and other != shuffled
    for b in range(3):  # each block of 4 holds the same windows, in another order
        assert sorted(shuffled[4 * b : 4 * b + 4]) == sorted(plain[4 * b : 4 * b + 4])


@pytest.mark.parametrize("shuffle", [0, 3])
def test_a_resumed_loader_hands_out_the_next_window_exactly(jsonl, shuffle):
    """At every step boundary (mid-document, block ends, the epoch's end): no window twice,
    none skipped; the state counts what was handed out, not what was prefetched."""
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl"), "shuffle_windows": shuffle})
    full = build_loader(r, 512, dp_rank=1, dp_size=2)
    steps = [full.next_step()[0].inputs.tolist() for _ in range(30)]  # past one epoch of rank 1's part
    full.close()
    for cut in (1, 2, 5, 11, 17):
        first = build_loader(r, 512, dp_rank=1, dp_size=2)
        for _ in range(cut):
            first.next_step()
        state = json.loads(json.dumps(first.state_dict()))  # as meta.json stores it
        first.close()
        resumed = build_loader(r, 512, dp_rank=1, dp_size=2)
        resumed.load_state_dict(state)
        assert [resumed.next_step()[0].inputs.tolist() for _ in range(4)] == steps[cut : cut + 4], cut
        resumed.close()


def test_resuming_on_another_dp_degree_follows_the_rule(jsonl):
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl")})
    old = [build_loader(r, 512, d, 2) for d in range(2)]
    for loader in old:
        for _ in range(3):
            loader.next_step()  # 3 steps x 2 windows per rank: 12 windows in all
    # what checkpoint_state gathers over the dp group in a run
    saved = {"data_corpus": {"dp": 2, "ranks": [x.state_dict() for x in old], "settings": old[0].fingerprint}}
    assert windows_to_skip(saved["data_corpus"]["ranks"], 1) == 12
    new = build_loader(r, 512, 0, 1)
    new.restore_from(saved)
    reference = windows(r).next_windows(14).tolist()  # one rank reading everything from the start
    assert new.next_step()[0].inputs.tolist() == [w[:-1] for w in reference[12:14]]
    for loader in [*old, new]:
        loader.close()


def test_parquet_text_and_a_local_dataset_by_name(tmp_path, jsonl):
    rows = [json.loads(line) for line in (jsonl / "part0.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "part0.parquet")
    (tmp_path / "books").mkdir()
    for i in range(2):
        (tmp_path / "books" / f"book{i}.txt").write_text(f"böok {i}\n\nsecond paragraph of {i}\n")
    want = packed([doc_text(0, i) for i in range(DOCS_PER_FILE)], 16)[:6]
    from_parquet = windows(recipe({"source": "files", "path": str(tmp_path / "*.parquet")})).next_windows(6)
    assert from_parquet.tolist() == want
    by_name = recipe({"source": "hf", "hf_dataset": str(jsonl), "split": "train"})
    assert [row["id"] for row in open_stream(by_name.data, "train", 0, 1)][:2] == ["0.0", "0.1"]
    text = recipe({"source": "files", "path": str(tmp_path / "books" / "*.txt")})  # a file is a document
    books = windows(text).next_windows(2).tolist()
    assert books == packed([f"böok {i}\n\nsecond paragraph of {i}\n" for i in range(2)], 16)[:2]
    assert ByteTokenizer().decode(books[0]).startswith("böok 0")  # UTF-8 bytes, BOS dropped


def test_an_hf_tokenizer_folder_brings_its_bos_and_eos(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world " * 20, "a corpus of text"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    hf = HFTokenizer(str(tmp_path))
    ids = hf.document("hello world")
    assert ids[0] == tok.token_to_id("<s>") and ids[-1] == tok.token_to_id("</s>")
    assert hf.decode(ids[1:-1]).strip() == "hello world" and hf.vocab_size == tok.get_vocab_size()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(DataError, match="names no eos_token"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(DataError, match="a special token is 5, not a token's text"):
        HFTokenizer(str(tmp_path))


def test_bad_corpora_are_errors_that_name_the_field(tmp_path, jsonl):
    with pytest.raises(DataNotFound, match="data.path = .*matches no files"):
        build_loader(recipe({"source": "files", "path": str(tmp_path / "none*.jsonl")}), 512)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "mixed" / "b.txt").write_text("x")
    with pytest.raises(DataError, match=r"kinds \['.jsonl', '.txt'\].*data.format"):
        build_loader(recipe({"source": "files", "path": str(tmp_path / "mixed" / "*")}), 512)
    loader = build_loader(
        recipe({"source": "files", "path": str(jsonl / "*.jsonl"), "text_column": "body"}), 512
    )
    with pytest.raises(DataError, match=r"part0.jsonl, line 1: no field 'body' \(it has \['id', 'text'\]\)"):
        loader.next_step()
    loader.close()
    with pytest.raises(DataError, match="has 258 tokens but model.vocab_size = 256"):
        build_loader(recipe({"source": "files", "path": str(jsonl / "*.jsonl")}), 256)
    (tmp_path / "tiny.jsonl").write_text('{"text": "x"}\n')
    tiny = build_loader(recipe({"source": "files", "path": str(tmp_path / "tiny.jsonl")}), 512)
    with pytest.raises(
        DataError, match=r"holds 0 window\(s\) of seq_len \+ 1 = 16 tokens, fewer than one step"
    ):
        tiny.next_step()
    tiny.close()
    short = build_loader(
        recipe({"source": "files", "path": str(jsonl / "part0.jsonl")}, micro_batch_size=8), 512
    )
    with pytest.raises(DataError, match=r"holds 6 window\(s\) .* fewer than one step takes \(8\)"):
        short.next_step()  # 6 windows in the part, 8 in a step: refused, not repeated within the step
    short.close()
    with pytest.raises(DataNotFound, match="data.hf_dataset = .*cannot be opened"):
        build_loader(recipe({"source": "hf", "hf_dataset": str(tmp_path / "nothing-here")}), 512)


def test_a_position_for_another_corpus_is_refused(jsonl):
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl")})
    loader = build_loader(r, 512)
    loader.next_step()
    saved = loader.checkpoint_state()
    loader.close()
    other = build_loader(recipe({"source": "files", "path": str(jsonl / "part0.jsonl")}), 512)
    with pytest.raises(CheckpointError, match=r"other data settings \(data.path: .*checkpoint.init_from"):
        other.restore_from(saved)
    reshuffled = build_loader(
        recipe({"source": "files", "path": str(jsonl / "*.jsonl"), "shuffle_windows": 8}), 512
    )
    with pytest.raises(CheckpointError, match=r"data.shuffle_windows: 0 -> 8\)"):
        reshuffled.restore_from(saved)  # another order: the position would skip or repeat windows
    reshuffled.close()
    with pytest.raises(CheckpointError, match="synthetic data position"):
        other.restore_from({"data_position": 64})
    other.close()
    assert isinstance(loader, CorpusLoader)


@pytest.mark.slow
def test_training_on_a_corpus_resumes_with_the_next_token(tmp_path):
    """dp 2 on 8 jsonl files (4 per rank), shuffled blocks: a run resumed from its step-3
    checkpoint logs the uninterrupted run's losses for steps 4-6 exactly (same mesh: the same
    windows, none twice, none skipped), and the checkpoint holds both ranks' positions; the
    held-out files' eval loss falls and is the same after the resume."""
    from support import QUICK, RECIPES, read_metrics, run_cli, run_recipe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(8):
        rows = [
            {"text": f"document {f}.{i}: " + "the quick brown fox " * (1 + (i * 7 + f) % 9)}
            for i in range(40)
        ]
        (corpus / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    for f in range(2):  # one held-out file per dp rank
        rows = [{"text": f"held out {f}.{i}: " + "the quick brown fox " * (1 + i % 5)} for i in range(30)]
        (held_out / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *QUICK,
        "eval.every=3",
        f"eval.path={held_out}/*.jsonl",
        "mesh.dp_shard=2",
        "mesh.tp=1",
        "mesh.pp=1",
        "model.vocab_size=320",
        "data.source=files",
        f"data.path={corpus}/*.jsonl",
        "data.shuffle_windows=5",
        "train.steps=6",
        f"output_dir={tmp_path}",
        "checkpoint.enabled=true",
        "checkpoint.interval=3",
    ]
    whole = run_recipe([*args, "run_name=whole"], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    step3 = tmp_path / "whole" / "checkpoints" / "step-00000003"
    meta = json.loads((step3 / "meta.json").read_text())["data_corpus"]
    assert meta["dp"] == 2 and [r["windows"] for r in meta["ranks"]] == [24, 24]  # 3 steps x 8 per rank
    resumed = run_recipe([*args, "run_name=resumed", f"checkpoint.load={step3}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole")}
    again = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resumed")}
    assert sorted(again) == [4, 5, 6] and all(again[s] == losses[s] for s in again), (losses, again)
    assert losses[6] < losses[1]  # it learns the corpus
    evals = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path / "whole") if "eval/loss" in r}
    evals_again = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path / "resumed") if "eval/loss" in r}
    assert sorted(evals) == [3, 6] and evals_again == {6: evals[6]} and evals[6] < evals[3]
    # on one process (another dp degree): the rule, said in the log; it trains on
    one = ["mesh.dp_shard=1", "run_name=one", "train.steps=4", f"checkpoint.load={step3}"]
    moved = run_cli([*args, *one], cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "data: dp 2 -> 1: this rank's new part skips its first 48 windows" in moved.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "one")] == [4]


def test_the_stream_runs_on_from_block_to_block(jsonl):
    """Repositioning an HF stream re-reads its shard up to the position: done once per epoch (and
    on a resume), never per block, or reading would grow quadratically with a file's length."""
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl"), "shuffle_windows": 2})
    w = windows(r)
    loads = []
    original = w.stream.load_state_dict
    w.stream.load_state_dict = lambda state: (loads.append(state), original(state))[1]
    w.next_windows(20)  # 10 blocks of the first epoch
    assert len(loads) == 1
    w.load_state_dict(w.state_dict())
    w.next_windows(1)
    assert len(loads) == 2  # a resume repositions once


@pytest.mark.slow
def test_text_cpu_learns_the_shipped_corpus(tmp_path):
    """The README's `run_recipe recipes/text_cpu.toml`, shortened: real text, the shipped BPE
    tokenizer, 2 ranks; the training and the held-out loss both fall."""
    from support import RECIPES, read_metrics, run_cli

    args = [str(RECIPES / "text_cpu.toml"), "train.steps=40", "eval.every=20", "logging.wandb=false"]
    proc = run_cli([*args, f"output_dir={tmp_path}"], cwd=tmp_path, fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "text_cpu")
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < math.log(2048)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert "eval loss" in proc.stdout and "held out" in proc.stdout


def test_a_gated_hub_tokenizer_that_cannot_be_read_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the network
    with pytest.raises(DataNotFound) as e:
        HFTokenizer("meta-llama/Llama-3.2-1B")
    message = str(e.value)
    assert "data.tokenizer = 'meta-llama/Llama-3.2-1B' cannot be downloaded" in message
    assert "hf auth login" in message
    assert (
        "hf download meta-llama/Llama-3.2-1B --include 'tokenizer*' --local-dir tokenizers/Llama-3.2-1B"
        in message
    )


def test_a_gated_repo_gets_the_friendly_message_and_a_bug_keeps_its_traceback(monkeypatch):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    url = "https://huggingface.co/api/models/meta-llama/Llama-3.2-1B/revision/main"
    response = httpx.Response(403, request=httpx.Request("GET", url))

    def gated(repo_id, **kwargs):  # what the hub answers a user without access
        raise GatedRepoError(f"Access to model {repo_id} is restricted.", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(DataNotFound) as e:
        HFTokenizer("meta-llama/Llama-3.2-1B")
    assert "cannot be downloaded (GatedRepoError: Access to model meta-llama/Llama-3.2-1B" in str(e.value)
    assert "hf auth login" in str(e.value)

    def buggy(repo_id, **kwargs):  # a bug on our side (a wrong argument) is not a download story
        raise TypeError("snapshot_download() got an unexpected keyword argument 'allow'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", buggy)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        HFTokenizer("meta-llama/Llama-3.2-1B")


def test_ranks_read_whole_files_even_when_dp_does_not_divide_their_count(jsonl):
    """4 files over 3 ranks: 2, 1 and 1 files, each rank only its own (FineWeb-Edu's sample has
    14 parquet files for llm_1b's 8 ranks)."""
    r = recipe({"source": "files", "path": str(jsonl / "*.jsonl")})
    parts = [[row["id"].split(".")[0] for row in open_stream(r.data, "train", d, 3)] for d in range(3)]
    assert [sorted(set(p)) for p in parts] == [["0", "3"], ["1"], ["2"]]
    assert sum(len(p) for p in parts) == N_FILES * DOCS_PER_FILE
