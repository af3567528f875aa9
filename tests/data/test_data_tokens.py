"""token_loader and fastpar data prepare: real text (the standard library's own sources) prepared into
shards, read back and checked against what is computed here from the files and the raw shard bytes."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpar.data import TokenDataError, document_mask, prepare_tokens, token_loader
from fastpar.user_errors import UserError

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(os.__file__).parent
TEXT_DIRS = [STDLIB / "json", STDLIB / "logging"]
EOT = 256
SEQ, B = 64, 4


def stdlib_files() -> list[Path]:
    return [p for d in TEXT_DIRS for p in sorted(d.rglob("*.py")) if "__pycache__" not in p.parts]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "prepared"
    prepare_tokens(TEXT_DIRS, out, suffixes=(".py",), val_fraction=0.2, shard_tokens=40_000, seed=3)
    return out


def raw_shards(folder: Path, split: str = "train") -> list[np.ndarray]:
    index = json.loads((folder / "index.json").read_text())
    return [np.fromfile(folder / s["file"], dtype="<u2") for s in index["splits"][split]["shards"]]


def all_windows(shards: list[np.ndarray], seq_len: int) -> collections.Counter:
    """Every window the data holds, by content: seq_len + 1 tokens starting every seq_len tokens of a shard."""
    found = collections.Counter()
    for tokens in shards:
        for k in range((len(tokens) - 1) // seq_len):
            found[tuple(tokens[k * seq_len : k * seq_len + seq_len + 1].tolist())] += 1
    return found


def window_rows(x: torch.Tensor, y: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row) for row in torch.cat([x, y[:, -1:]], dim=1).tolist()]


def global_stream(source, world_size: int, batches: int | None = None, **kw) -> list[tuple[int, ...]]:
    """The windows every rank reads, global batch after global batch, ranks in order within each."""
    loaders = [
        token_loader(source, seq_len=SEQ, batch_size=B, rank=r, world_size=world_size, **kw) for r in range(world_size)
    ]
    per_rank = [list(loader)[:batches] for loader in loaders]
    assert len({len(batches_) for batches_ in per_rank}) == 1, "ranks got different batch counts"
    stream = []
    for step in zip(*per_rank, strict=True):
        for x, y in step:
            stream += window_rows(x, y)
    return stream


def test_prepare_then_load_roundtrip_decodes_to_the_text(prepared):
    index = json.loads((prepared / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 257 and index["eot_token"] == EOT
    assert index["tokenizer"] == "bytes"
    files = stdlib_files()
    texts = [p.read_bytes() for p in files]
    docs = {}
    for split in ("train", "val"):
        stream = np.concatenate(raw_shards(prepared, split))
        assert len(stream) == index["splits"][split]["tokens"]
        assert stream[-1] == EOT
        docs[split] = [bytes(part[:-1].tolist()) for part in np.split(stream, np.flatnonzero(stream == EOT) + 1)[:-1]]
        assert len(docs[split]) == index["splits"][split]["documents"]
    assert len(docs["val"]) == round(0.2 * len(files))
    assert sorted(docs["train"] + docs["val"]) == sorted(texts)
    assert docs["train"] == [t for t in texts if t in docs["train"]]  # train keeps the files' order
    assert len(index["splits"]["train"]["shards"]) >= 3


def test_batches_are_shifted_windows_of_the_shards(prepared):
    expected = all_windows(raw_shards(prepared), SEQ)
    loader = token_loader(prepared, seq_len=SEQ, batch_size=B, seed=1)
    assert len(loader) == sum(expected.values()) // B
    seen = collections.Counter()
    for x, y in loader:
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen.update(window_rows(x, y))
    assert not seen - expected  # nothing read that is not a window of the data, none twice
    assert sum(seen.values()) == len(loader) * B


def test_ranks_read_disjoint_windows_in_the_same_global_order_at_any_world_size(prepared):
    one = global_stream(prepared, 1, seed=5)
    assert len(set(one)) > 0.99 * len(one)  # the windows are (nearly all) distinct text
    for world_size in (2, 3):
        many = global_stream(prepared, world_size, seed=5)
        n = len(one) // (B * world_size) * B * world_size  # the tail that fills no global batch is dropped
        assert len(many) == n
        assert many == one[:n]  # same order, so each window on exactly one rank
    assert one != global_stream(prepared, 1, seed=6)


def test_set_epoch_reshuffles_and_repeats(prepared):
    loader = token_loader(prepared, seq_len=SEQ, batch_size=B)
    first = [window_rows(x, y) for x, y in loader]
    second = [window_rows(x, y) for x, y in loader]  # the next pass is epoch 1
    loader.set_epoch(0)
    again = [window_rows(x, y) for x, y in loader]
    assert first == again and first != second
    assert sorted(sum(first, [])) == sorted(sum(second, []))


def test_resume_is_exact(prepared):
    whole = token_loader(prepared, seq_len=SEQ, batch_size=B, seed=2)
    whole.set_epoch(4)
    expected = [window_rows(x, y) for x, y in whole]
    loader = token_loader(prepared, seq_len=SEQ, batch_size=B, seed=2)
    loader.set_epoch(4)
    got = []
    for step, (x, y) in enumerate(loader):
        got.append(window_rows(x, y))
        if step == 70:  # past the loader's first chunk of 64 batches' window starts
            break
    state = loader.state_dict()
    assert state["epoch"] == 4 and state["samples_consumed"] == 71 * B and state["seed"] == 2
    resumed = token_loader(prepared, seq_len=SEQ, batch_size=B, seed=2)
    resumed.load_state_dict(state)
    got += [window_rows(x, y) for x, y in resumed]
    assert got == expected
    assert resumed.state_dict()["epoch"] == 5 and resumed.state_dict()["samples_consumed"] == 0
    with pytest.raises(TokenDataError, match="seed"):
        token_loader(prepared, seq_len=SEQ, batch_size=B, seed=9).load_state_dict(state)


def test_resume_from_two_ranks_on_three_repeats_and_skips_nothing(prepared):
    one = global_stream(prepared, 1, seed=8)
    two = [token_loader(prepared, seq_len=SEQ, batch_size=B, rank=r, world_size=2, seed=8) for r in range(2)]
    before = []
    iterators = [iter(loader) for loader in two]
    for _ in range(5):
        for it in iterators:
            before += window_rows(*next(it))
    states = [loader.state_dict() for loader in two]
    assert states[0] == states[1] and states[0]["samples_consumed"] == 5 * 2 * B
    three = [token_loader(prepared, seq_len=SEQ, batch_size=B, rank=r, world_size=3, seed=8) for r in range(3)]
    for loader in three:
        loader.load_state_dict(states[0])
    after = []
    for step in zip(*three, strict=True):
        for x, y in step:
            after += window_rows(x, y)
    rest = (len(one) - len(before)) // (3 * B) * 3 * B
    assert before + after == one[: len(before) + rest]
    assert len(after) == rest > 0


def test_token_ids_at_or_above_vocab_size_are_an_error(prepared):
    loader = token_loader(prepared, seq_len=SEQ, batch_size=B, vocab_size=100)  # '{' is 123
    with pytest.raises(TokenDataError, match=r"not below vocab_size 100"):
        next(iter(loader))
    next(iter(token_loader(prepared, seq_len=SEQ, batch_size=B)))  # the index's 257 holds


def test_bad_inputs_are_one_clear_error_before_the_first_step(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(TokenDataError, match="not a multiple of 2"):
        token_loader(odd, seq_len=1, batch_size=1, dtype="uint16")
    with pytest.raises(TokenDataError, match="unknown width"):
        token_loader(odd, seq_len=1, batch_size=1)
    short = tmp_path / "short.bin"
    np.arange(50, dtype=np.uint16).tofile(short)
    with pytest.raises(TokenDataError, match="fewer than one window of seq_len"):
        token_loader(short, seq_len=64, batch_size=1, dtype="uint16")
    with pytest.raises(TokenDataError, match="fewer than one global batch"):
        token_loader(short, seq_len=8, batch_size=4, world_size=2, rank=0, dtype="uint16")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenDataError, match="holds no .bin or .npy token files"):
        token_loader(empty, seq_len=8, batch_size=1)
    with pytest.raises(TokenDataError, match="matches no files"):
        token_loader(str(tmp_path / "nothing_*.bin"), seq_len=8, batch_size=1, dtype="uint16")
    (tmp_path / "notes.txt").write_text("not tokens")
    with pytest.raises(TokenDataError, match=r"matches no .bin or .npy files"):
        token_loader(str(tmp_path / "*.txt"), seq_len=8, batch_size=1, dtype="uint16")
    signed = tmp_path / "signed.npy"
    np.save(signed, np.array([5, 3, -1, 7] * 10, dtype=np.int32))
    with pytest.raises(TokenDataError, match="negative token id"):
        next(iter(token_loader(signed, seq_len=8, batch_size=4, shuffle=False)))
    with pytest.raises(TokenDataError, match="no such file"):
        token_loader(tmp_path / "missing.bin", seq_len=8, batch_size=1, dtype="uint16")
    with pytest.raises(TokenDataError, match="not a token dtype"):
        token_loader(short, seq_len=8, batch_size=1, dtype="float32")
    assert issubclass(TokenDataError, ValueError) and issubclass(TokenDataError, UserError)


def test_packing_positions_documents_and_mask(tmp_path):
    e = 9
    tokens = np.array([1, 2, e, 3, 4, 5, e, 6, 7, e, e, 8, 1, 2, 3, 4, 5], dtype=np.uint16)
    path = tmp_path / "docs.bin"
    tokens.tofile(path)
    loader = token_loader(path, seq_len=8, batch_size=2, dtype="uint16", shuffle=False, eot_token=e)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert batch["input_ids"].tolist() == [tokens[0:8].tolist(), tokens[8:16].tolist()]
    assert batch["labels"].tolist() == [tokens[1:9].tolist(), tokens[9:17].tolist()]
    # row 0: 1 2 e | 3 4 5 e | 6 ; row 1: 7 e | e | 8 1 2 3 4
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 2, 2, 2, 2, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 0, 1, 2, 3, 4]]
    mask = document_mask(batch["document_ids"])
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    docs = batch["document_ids"]
    for b in range(2):
        for i in range(8):
            for j in range(8):
                assert mask[b, 0, i, j].item() == (j <= i and docs[b, i].item() == docs[b, j].item())
    # with the mask, attention over the packed row equals attention over each document alone
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))
    packed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for b in range(2):
        for doc in docs[b].unique().tolist():
            cols = (docs[b] == doc).nonzero().flatten()
            alone = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1, :, cols], k[b : b + 1, :, cols], v[b : b + 1, :, cols], is_causal=True
            )
            torch.testing.assert_close(packed[b : b + 1, :, cols], alone)


def test_uint32_npy_folder_and_glob(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.integers(0, 100_000, size=1000, dtype=np.uint32)
    (tmp_path / "wide").mkdir()
    big.tofile(tmp_path / "wide" / "a.bin")
    x, y = next(iter(token_loader(tmp_path / "wide" / "a.bin", seq_len=10, batch_size=3, dtype="uint32")))
    assert x.max().item() >= 65536  # read as 32-bit tokens, not pairs of 16-bit halves
    expected = all_windows([big], 10)
    assert all(expected[w] for w in window_rows(x, y))

    parts = [rng.integers(0, 1000, size=n).astype(np.uint16) for n in (300, 500, 401)]
    (tmp_path / "npy").mkdir()
    (tmp_path / "bins").mkdir()
    for i, part in enumerate(parts):
        np.save(tmp_path / "npy" / f"part{i}.npy", part)
        part.tofile(tmp_path / "bins" / f"part{i}.bin")
    expected = all_windows(parts, 10)
    for source, kw in [
        (tmp_path / "npy", {}),
        (str(tmp_path / "npy" / "part*.npy"), {}),
        (tmp_path / "bins", {"dtype": np.uint16}),
        (str(tmp_path / "bins" / "*.bin"), {"dtype": "uint16"}),
    ]:
        seen = collections.Counter()
        loader = token_loader(source, seq_len=10, batch_size=4, **kw)
        for x, y in loader:
            seen.update(window_rows(x, y))
        assert not seen - expected and sum(seen.values()) == sum(expected.values()) // 4 * 4, source
    only_first = token_loader(str(tmp_path / "npy" / "part0.npy"), seq_len=10, batch_size=1)
    assert len(only_first) == 29


def test_prepared_val_split_and_shard_given_by_name(prepared):
    val = token_loader(prepared, split="val", seq_len=SEQ, batch_size=B)
    assert sum(len(x) for x, _ in val) == sum(all_windows(raw_shards(prepared, "val"), SEQ).values()) // B * B
    one = token_loader(prepared / "train_000000.bin", seq_len=SEQ, batch_size=B)  # dtype from the folder's index
    assert len(one) == (40_000 - 1) // SEQ // B
    with pytest.raises(TokenDataError, match="no shards for split 'test'"):
        token_loader(prepared, split="test", seq_len=SEQ, batch_size=B)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "fastpar", "data", "prepare", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_prepare_with_a_glob_and_a_file(tmp_path):
    glob_arg = str(STDLIB / "json" / "*.py")
    done = run_cli(glob_arg, str(STDLIB / "this.py"), "--out", str(tmp_path / "out"), "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    assert "train:" in done.stdout and "index.json" in done.stdout
    files = sorted((STDLIB / "json").glob("*.py")) + [STDLIB / "this.py"]
    stream = np.concatenate(raw_shards(tmp_path / "out"))
    assert bytes(stream[stream != EOT].tolist()) == b"".join(p.read_bytes() for p in files)
    assert int((stream == EOT).sum()) == len(files)


@pytest.mark.parametrize(
    "tokenizer, says",
    [
        ("tiktoken:gpt2", "pip install tiktoken"),
        ("hf:/no/such/tokenizer.json", "no such tokenizer.json"),
        ("sentencepiece:x", "unknown tokenizer"),
    ],
)
def test_cli_tokenizer_problems_are_one_line(tmp_path, tokenizer, says):
    if tokenizer.startswith("tiktoken") and importlib.util.find_spec("tiktoken"):
        pytest.skip("tiktoken is installed here")
    done = run_cli(str(STDLIB / "this.py"), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("fastpar data: error:"), done.stderr


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    text = (STDLIB / "json" / "decoder.py").read_text()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    index = prepare_tokens(
        STDLIB / "json" / "decoder.py", tmp_path / "out", tokenizer=f"hf:{tmp_path / 'tokenizer.json'}"
    )
    assert index["eot_token"] == tok.token_to_id("<|endoftext|>") and index["vocab_size"] == tok.get_vocab_size()
    stream = np.concatenate(raw_shards(tmp_path / "out"))
    assert stream.tolist() == tok.encode(text, add_special_tokens=False).ids + [index["eot_token"]]


@pytest.fixture(scope="module")
def s3_server(prepared, tmp_path_factory):
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from fastpar.data.remote.local_s3 import LocalS3

    base = tmp_path_factory.mktemp("bucket")
    shutil.copytree(prepared, base / "corpus")
    saved = dict(os.environ)
    with LocalS3({"tokens": base}) as s3:
        os.environ.update(s3.env(), AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull)
        yield s3
    os.environ.clear()
    os.environ.update(saved)


def test_s3_prefix_reads_the_same_batches_through_the_cache(prepared, s3_server, tmp_path):
    local = [window_rows(x, y) for x, y in token_loader(prepared, seq_len=SEQ, batch_size=B, seed=4)]
    cache = tmp_path / "cache"
    remote = token_loader("s3://tokens/corpus", seq_len=SEQ, batch_size=B, seed=4, cache_dir=cache)
    assert [window_rows(x, y) for x, y in remote] == local
    cached = sorted(p for p in cache.rglob("*") if p.is_file() and len(p.name) == 64)
    assert sorted(p.stat().st_size for p in cached) == sorted(
        (prepared / s["file"]).stat().st_size
        for s in json.loads((prepared / "index.json").read_text())["splits"]["train"]["shards"]
    )
    s3_server.clear()
    again = token_loader("s3://tokens/corpus", seq_len=SEQ, batch_size=B, seed=4, cache_dir=cache)
    assert [window_rows(x, y) for x, y in again][:3] == local[:3]
    assert s3_server.object_gets() == 1  # only index.json: the shards come from the cache
    with pytest.raises(TokenDataError, match="no shards for split 'test'"):
        token_loader("s3://tokens/corpus", split="test", seq_len=SEQ, batch_size=B, cache_dir=cache)
