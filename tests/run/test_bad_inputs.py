"""Bad data, tokenizer and checkpoint files, tried as a user would, through the CLI: each stops
the run with the file (and line or row), what is wrong and the fix, and no traceback; exit 2
when found before training (the pre-launch check, --dry-run), 1 when a rank's streaming reader
meets it in training (one message, run.json failed with it, metrics.jsonl keeping its steps).
The files are made here, tiny; the bad ones share a few runs (the check reports them all)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from support import QUICK, read_metrics, run_cli

pytest.importorskip("datasets")

# one process on a local corpus (the launched test adds mesh.dp_shard=2)
CORPUS_RUN = ["debug_cpu", "mesh.tp=1", "mesh.pp=1", "data.source=files"]
SINGLE = [*CORPUS_RUN, "mesh.dp_shard=1", "model.vocab_size=320"]
GOOD = "".join(json.dumps({"text": f"document {i}: the quick brown fox"}) + "\n" for i in range(20))


def bad_tokenizers(root: Path) -> dict[str, Path]:
    """A real BPE tokenizer (300 tokens) and folders where one of its files is wrong."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox " * 30, "jumps over the lazy dog " * 30], trainer)
    folders = {name: root / name for name in ("broken", "config_not_json", "no_eos", "too_big", "good")}
    for name, folder in folders.items():
        folder.mkdir(parents=True)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    text = (folders["broken"] / "tokenizer.json").read_text()
    (folders["broken"] / "tokenizer.json").write_text(text[: len(text) // 2])  # a download cut short
    (folders["config_not_json"] / "tokenizer_config.json").write_text("{bos_token: <s>\n")
    (folders["no_eos"] / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return folders


def bad_checkpoints(root: Path) -> dict[str, Path]:
    """A real seed checkpoint and its HF export, and copies broken one way each."""
    from meshforge.convert import export_checkpoint, write_seed
    from meshforge.recipe import load_recipe

    seed = write_seed(load_recipe("debug_cpu", ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]), root / "seed")
    export_checkpoint(seed, root / "hf", "hf")
    out = {"seed": seed, "file": root / "model.pt"}
    out["file"].write_bytes(b"not a folder")
    broken = (
        "missing_shard",
        "truncated_shard",
        "bad_metadata",
        "meta_not_json",
        "meta_without_step",
        "no_meta",
    )
    for name in broken:
        out[name] = root / name / seed.name
        shutil.copytree(seed, out[name])
    shards = sorted(out["missing_shard"].glob("*.distcp"))
    shards[0].unlink()
    shard = sorted(out["truncated_shard"].glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    (out["bad_metadata"] / ".metadata").write_bytes(b"\x80\x04garbage")
    (out["no_meta"] / "meta.json").unlink()
    (out["meta_not_json"] / "meta.json").write_text('{"step": 0, "recipe": {')
    meta = json.loads((seed / "meta.json").read_text())
    (out["meta_without_step"] / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "step"})
    )
    for name in ("hf_truncated", "hf_config_not_json"):
        out[name] = root / name
        shutil.copytree(root / "hf", out[name])
    weights = out["hf_truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (out["hf_config_not_json"] / "config.json").write_text('{"model_type": "llama",')
    return out


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("bad")
    files = {
        "jsonl/good.jsonl": GOOD.encode(),
        "jsonl/not_json.jsonl": ("".join(GOOD.splitlines(True)[:2]) + '{"text": "cut\n').encode(),
        "jsonl/number.jsonl": (json.dumps({"text": "a"}) + "\n" + json.dumps({"text": 42}) + "\n").encode(),
        "jsonl/null.jsonl": (json.dumps({"text": None}) + "\n").encode(),
        "jsonl/no_column.jsonl": (json.dumps({"body": "x"}) + "\n").encode(),
        "jsonl/bom.jsonl": b"\xef\xbb\xbf" + GOOD.encode(),
        "jsonl/binary.jsonl": gzip.compress(GOOD.encode()),
        "jsonl/empty.jsonl": b"",
        "jsonl/array.jsonl": (GOOD.splitlines(True)[0] + '["text", "x"]\n').encode(),
        "text/latin1.txt": "first line\ncaf\xe9 au lait\n".encode("latin-1"),
        "text/bom.txt": b"\xef\xbb\xbfhello\n",
        "text/empty.txt": b"",
        "mixed/a.jsonl": GOOD.encode(),
        "mixed/b.txt": b"text\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": ["a", "b", "c"] * 50}), root / "parquet" / "truncated.parquet")
    whole = (root / "parquet" / "truncated.parquet").read_bytes()
    (root / "parquet" / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(pa.table({"body": ["a"]}), root / "parquet" / "no_column.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "parquet" / "int_column.parquet")
    nested = [{"lang": "en", "score": 1}] * 4  # a struct column before the text: leaf indices differ
    pq.write_table(
        pa.table({"meta": nested, "text": ["a", "b", None, "d"]}), root / "parquet" / "null_row.parquet"
    )
    out = {"root": root}
    out.update({f"tok_{k}": v for k, v in bad_tokenizers(root / "tokenizers").items()})
    out.update(bad_checkpoints(root / "checkpoints"))
    return out


def refused(proc, *expected: str) -> str:
    """The run stopped before training with exit 2, one problem line per expected text, no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    missing = [e for e in expected if e not in proc.stderr]
    assert not missing, (missing, proc.stderr)
    return proc.stderr


def dry_run(tmp_path: Path, *fields: str, base: list[str] = SINGLE):
    return run_cli([*base, *fields, "--dry-run"], cwd=tmp_path)


def test_bad_jsonl_parquet_tokenizer_and_checkpoint_paths_are_named_at_dry_run(bad, tmp_path):
    root = bad["root"]
    proc = dry_run(
        tmp_path,
        f"data.path={root}/jsonl/*.jsonl",
        f"eval.path={root}/parquet/*.parquet",
        "eval.every=10",
        f"data.tokenizer={bad['tok_broken']}",
        f"checkpoint.load={bad['file']}",
        f"checkpoint.init_from={bad['missing_shard']}",
    )
    j, p = f"{root}/jsonl", f"{root}/parquet"
    err = refused(
        proc,
        f"{j}/not_json.jsonl, line 3: not JSON (Unterminated string",
        f"{j}/number.jsonl, line 2: field 'text' is a number (42), not a string",
        f"{j}/null.jsonl, line 1: field 'text' is null, not a string",
        f"{j}/no_column.jsonl, line 1: no field 'text' (it has ['body']); set data.text_column",
        f"{j}/bom.jsonl: starts with a UTF-8 byte-order mark",
        f"{j}/binary.jsonl, line 1: not UTF-8 text (0x8b at byte 1): a binary file?",
        f"{j}/empty.jsonl: the file is empty (0 bytes)",
        f"{j}/array.jsonl, line 2: an array, not an object with a 'text' field",
        f"{p}/truncated.parquet: not a readable parquet file (Parquet magic bytes not found",
        f"{p}/no_column.parquet: no column 'text' (it has ['body'])",
        f"{p}/int_column.parquet: column 'text' holds int64, not strings",
        f"{p}/null_row.parquet, row 2 (counting from 0): column 'text' is null",
        f"{bad['tok_broken']}/tokenizer.json: not JSON (",
        f"checkpoint.load = '{bad['file']}': is a file, not a checkpoint",
        f"{bad['missing_shard']}/__0_0.distcp is missing (.metadata lists it)",
    )
    assert "good.jsonl" not in err and "error: what the run reads: 15 problem(s)" in err
    assert err.count("data.path = ") == 8 and err.count("eval.path = ") == 4


def test_bad_text_tokenizer_config_and_meta_json_are_named_at_dry_run(bad, tmp_path):
    root = bad["root"]
    proc = dry_run(
        tmp_path,
        f"data.path={root}/text/*.txt",
        f"eval.path={root}/nothing/*.jsonl",
        "eval.every=10",
        f"data.tokenizer={bad['tok_config_not_json']}",
        f"checkpoint.load={bad['meta_not_json'].parent}",
        f"checkpoint.init_from={bad['truncated_shard']}",
    )
    shard = sorted(bad["truncated_shard"].glob("*.distcp"))[0]
    refused(
        proc,
        f"{root}/text/latin1.txt, line 2 (byte 14): not UTF-8 (0xe9: invalid continuation byte)",
        "iconv -f latin1 -t utf-8",
        f"{root}/text/bom.txt: starts with a UTF-8 byte-order mark",
        f"{root}/text/empty.txt: the file is empty (0 bytes)",
        f"eval.path = '{root}/nothing/*.jsonl': matches no files; check the glob",
        f"{bad['tok_config_not_json']}/tokenizer_config.json: not JSON (Expecting property name enclosed "
        "in double quotes: line 1, column 2)",
        f"{bad['meta_not_json']}/meta.json is not JSON (",
        f"{shard} holds 100 bytes where .metadata needs",
    )


def test_bad_inputs_stop_the_launch_itself_before_anything_runs(bad, tmp_path):
    """Without --dry-run: the same checks run before training (or launching), exit 2, no records."""
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(bad["tok_too_big"] / "tokenizer.json")).get_vocab_size()
    proc = run_cli(
        [
            *SINGLE,
            f"model.vocab_size={n - 1}",
            f"data.path={bad['root']}/mixed/*",
            f"data.tokenizer={bad['tok_too_big']}",
            f"checkpoint.load={bad['bad_metadata']}",
            f"checkpoint.init_from={bad['meta_without_step']}",
            f"output_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    refused(
        proc,
        "matches files of kinds ['.jsonl', '.txt']; one of .jsonl/.json, .parquet, .txt/.md per corpus",
        f"has {n} tokens but model.vocab_size = {n - 1}; set model.vocab_size >= {n}",
        f"{bad['bad_metadata']}/.metadata is unreadable (",
        f"{bad['meta_without_step']}/meta.json has no step: not a meshforge checkpoint's meta.json",
    )
    assert not (tmp_path / "debug_cpu").exists()  # nothing started, no records


def test_a_truncated_safetensors_file_and_a_tokenizer_without_eos(bad, tmp_path):
    proc = dry_run(
        tmp_path,
        f"data.path={bad['root']}/jsonl/good.jsonl",
        f"data.tokenizer={bad['tok_no_eos']}",
        f"checkpoint.init_from_hf={bad['hf_truncated']}",
        f"checkpoint.load={bad['no_meta']}",
        base=SINGLE[:-1],  # the seed's vocabulary, so that the HF folder matches the recipe's model
    )
    refused(
        proc,
        f"{bad['hf_truncated']}/model.safetensors is not a readable safetensors file (Error while "
        "deserializing header: incomplete metadata, file not fully covered); a truncated download?",
        "names no eos_token",
        f"checkpoint.load = '{bad['no_meta']}': no complete checkpoint there; use 'auto', 'latest' "
        "or a step-NNNNNNNN folder with meta.json",
    )
    proc = dry_run(tmp_path, f"model.hf={bad['hf_config_not_json']}", base=SINGLE[:-1])
    refused(
        proc, f"model.hf = '{bad['hf_config_not_json']}': {bad['hf_config_not_json']}/config.json is not JSON"
    )


def test_the_streaming_reader_names_the_file_and_line_past_the_checked_head(tmp_path):
    """What the pre-launch check does not read (past `PEEK_BYTES`) is checked as it streams:
    a null text and a line that is not JSON, each named by file and line (one process, no launch)."""
    from meshforge.configs import Recipe
    from meshforge.core.errors import DataError
    from meshforge.run.data.loader import build_loader, check_data
    from meshforge.run.data.verify import PEEK_BYTES

    long = "".join(
        json.dumps({"text": f"document {i}: " + "jumps over the lazy dog " * 3}) + "\n" for i in range(900)
    )
    assert len(long) > PEEK_BYTES
    for name, line in (("null", json.dumps({"text": None})), ("cut", '{"text": "cut')):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "a.jsonl").write_text(GOOD)
        (folder / "b.jsonl").write_text(long + line + "\n" + GOOD)
        r = Recipe()
        r.data.source, r.data.path, r.model.vocab_size = "files", f"{folder}/*.jsonl", 320
        r.train.seq_len, r.train.micro_batch_size = 32, 64
        assert check_data(r, 320)[0].startswith("2 local json files")  # the heads are fine
        loader = build_loader(r, 320)
        with pytest.raises(DataError, match=rf"{folder}/b.jsonl, line 901: (field 'text' is null|not JSON)"):
            for _ in range(200):
                loader.next_step()
        loader.close()


@pytest.mark.slow
def test_a_bad_line_deep_in_a_corpus_ends_a_launched_run_with_one_message(tmp_path):
    """dp 2: rank 1 reads part1 (fine), then part3, whose line 901 (past the checked head) is cut:
    the run trains until then and ends with exit 1 and one line naming the file and line; no
    traceback on the terminal, run.json failed with the message, metrics.jsonl keeps its steps."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(3):
        rows = [{"text": f"document {f}.{i}: the quick brown fox"} for i in range(20)]
        (corpus / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    late = "".join(
        json.dumps({"text": f"late {i}: " + "jumps over the lazy dog " * 3}) + "\n" for i in range(900)
    )
    (corpus / "part3.jsonl").write_text(late + '{"text": "cut\n' + GOOD)
    launch = ["mesh.dp_shard=2", "model.vocab_size=320", f"data.path={corpus}/*.jsonl", "train.steps=30"]
    proc = run_cli([*CORPUS_RUN, *QUICK, *launch, f"output_dir={tmp_path}", "run_name=bad"], cwd=tmp_path)
    message = f"{corpus}/part3.jsonl, line 901: not JSON (Unterminated string"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count(message) == 1 and "rank 1 failed" in proc.stderr, proc.stderr[-3000:]
    info = json.loads((tmp_path / "bad" / "run.json").read_text())
    assert info["status"] == "failed" and message in info["error"]
    steps = [r["step"] for r in read_metrics(tmp_path / "bad")]
    assert steps and steps == list(range(1, len(steps) + 1)) and len(steps) < 30  # trained until the file
