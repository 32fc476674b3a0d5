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
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
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
            config = json.loads(path.read_text())
            for key in ("bos_token", "eos_token"):
                value = config.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if value is not None:
                    found[key] = value
    return found


def build_tokenizer(spec: str):
    """`byte`, or an HF tokenizer (folder, tokenizer.json, hub id)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
