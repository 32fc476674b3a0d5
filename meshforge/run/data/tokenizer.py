"""Tokenizers that know their documents' boundaries: bytes (nothing to download) or an HF
tokenizer (a folder with tokenizer.json and tokenizer_config.json, a bare tokenizer.json beside
its config, or a hub id where the network allows), read with the `tokenizers` library.

`document(text)` is what the corpus packs: BOS (when the tokenizer has one), the text's
tokens, EOS (required: without it documents would run into each other unmarked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from meshforge.core.errors import DataError, DataNotFound


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, BOS 256, EOS 257."""

    vocab_size = 258
    bos_id, eos_id = 256, 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def document(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text), self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """An HF fast tokenizer with the BOS/EOS its tokenizer_config.json names."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer

        folder = _local_folder(spec)
        self.spec = spec
        path = folder / "tokenizer.json"
        text = _read_json_text(path, "a tokenizer")
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for JSON that is not a tokenizer
            if type(e) is not Exception:
                raise
            raise DataError(
                f"data.tokenizer = {spec!r}: {path} is JSON but not a tokenizer ({str(e)[:160]}); "
                "save it with tokenizers' Tokenizer.save (or transformers' save_pretrained)"
            ) from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _special_tokens(folder)
        self.bos_id = self._id(config.get("bos_token"))
        self.eos_id = self._id(config.get("eos_token"))
        if self.eos_id is None:
            raise DataError(
                f"data.tokenizer = {spec!r} names no eos_token (tokenizer_config.json or "
                "special_tokens_map.json beside tokenizer.json): documents need an end marker"
            )

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if not isinstance(token, str):
            raise DataError(
                f"data.tokenizer = {self.spec!r}: a special token is {token!r}, not a token's text; "
                "set bos_token/eos_token in tokenizer_config.json to strings"
            )
        found = self._tok.token_to_id(token)
        if found is None:
            raise DataError(
                f"data.tokenizer = {self.spec!r}: its special token {token!r} is not in its vocabulary"
            )
        return found

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def document(self, text: str) -> list[int]:
        head = [] if self.bos_id is None else [self.bos_id]
        return [*head, *self.encode(text), self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def _local_folder(spec: str) -> Path:
    """The folder holding tokenizer.json: `spec` itself, its parent, or a hub download."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.parent
    if (path / "tokenizer.json").is_file():
        return path
    if not is_hub_id(spec):
        raise DataNotFound(
            f"data.tokenizer = {spec!r}: no tokenizer.json there; use 'byte', a folder or a hub id"
        )
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:  # a hub id ("org/name"): its tokenizer files only
        return Path(snapshot_download(spec, allow_patterns=["tokenizer*", "special_tokens_map.json"]))
    # what a download can meet: HTTP errors (gated, not found: HfHubHTTPError is an OSError),
    # no network or offline mode (httpx's errors, OSError), a name the hub refuses
    except (OSError, httpx.HTTPError, HFValidationError) as e:
        raise DataNotFound(
            f"data.tokenizer = {spec!r} cannot be downloaded ({type(e).__name__}: {str(e)[:200]}). "
            f"Gated models (meta-llama/*) need access on the hub and `hf auth login`; offline, fetch it "
            f"once with `hf download {spec} --include 'tokenizer*' "
            f"--local-dir tokenizers/{spec.split('/')[-1]}` "
            "and set data.tokenizer to that folder"
        ) from None


def is_hub_id(spec: str) -> bool:
    """`org/name` that is not a local path: read from the hub (never at --dry-run)."""
    local = Path(spec).expanduser().exists() or spec.startswith((".", "/", "~"))
    return spec != "byte" and not local and spec.count("/") == 1


def _special_tokens(folder: Path) -> dict:
    """bos_token/eos_token as strings, from tokenizer_config.json (or special_tokens_map.json)."""
    found: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        path = folder / name
        if path.is_file():
            config = json.loads(_read_json_text(path, "a JSON object"))
            if not isinstance(config, dict):
                raise DataError(f"{path}: not a JSON object; save it again (save_pretrained)")
            for key in ("bos_token", "eos_token"):
                value = config.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if value is not None:
                    found[key] = value
    return found


def _read_json_text(path: Path, what: str) -> str:
    """A tokenizer file's text, refused naming the file and the line when it is not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}), so not {what}; download it again") from e
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: not JSON ({e.msg}: line {e.lineno}, column {e.colno}), so not {what}; "
            "a truncated download? fetch it again"
        ) from e
    return text


def build_tokenizer(spec: str):
    """`byte`, or an HF tokenizer (folder, tokenizer.json, hub id)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
