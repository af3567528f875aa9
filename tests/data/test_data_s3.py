"""image_loader("s3://...") against a real S3 server: moto's server in its own process on 127.0.0.1.

Every comparison is with the same images read from a local folder with the same seed (torch.equal);
request counts come from the server's own log. Backends: torch (DataLoader), DALI fed by the client,
and DALI's own S3 reader (fn.io.file.read); DALI runs on CPU threads here.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import warnings

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from fastpar._optional import available  # noqa: E402
from fastpar.data import CorruptImageError, image_loader, make_image_folder, rank_batches  # noqa: E402
from fastpar.data.remote.errors import (  # noqa: E402
    BucketNotFoundError,
    ObjectReadError,
    StoreAccessError,
    StoreUnreachableError,
    UnsafeObjectKeyError,
)
from fastpar.data.remote.local_s3 import LocalS3  # noqa: E402
from fastpar.data.remote.store import StoreOptions  # noqa: E402
from fastpar.launcher import spawn  # noqa: E402

HAS_DALI = available("nvidia.dali")
SIZE = 24
PATIENT = StoreOptions(retries=30, max_backoff_s=2.0)  # outlasts a server restart on a loaded machine
NO_DALI = pytest.mark.skipif(not HAS_DALI, reason="no DALI")
MODES = [
    pytest.param(("torch", "client"), id="torch"),
    pytest.param(("dali", "client"), id="dali-client", marks=[NO_DALI, pytest.mark.slow]),
    pytest.param(("dali", "dali"), id="dali-reader", marks=[NO_DALI, pytest.mark.slow]),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """imgs/train: 4 classes x 9 images; mixed/train: a non-image object and an undecodable .jpg."""
    base = tmp_path_factory.mktemp("s3data")
    make_image_folder(base / "imgs" / "train", classes=4, per_class=9, size=(64, 48), seed=0)
    mixed = make_image_folder(base / "mixed" / "train", classes=2, per_class=3, size=(64, 48), seed=1)
    (mixed / "00_red" / "notes.txt").write_text("not an image")
    (mixed / "01_green" / "00001.jpg").write_bytes(b"\xff\xd8 truncated jpeg")
    return base


@pytest.fixture(scope="module")
def server(folders):
    """The server, and this process's AWS settings pointing at it (spawned ranks inherit them)."""
    saved = dict(os.environ)
    with LocalS3({"imgs": folders / "imgs", "mixed": folders / "mixed"}) as s3:
        os.environ.update(s3.env(), AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull)
        yield s3
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def s3(server):
    server.clear()
    yield server
    server.clear()


def load(root, backend="torch", reader="client", batch_size=4, storage=None, **kw):
    kw.setdefault("num_threads", 0 if backend == "torch" else 1)
    storage = storage or StoreOptions()
    if str(root).startswith("s3://"):
        kw["storage"] = StoreOptions(**{**storage.__dict__, "reader": reader})
    return image_loader(str(root), batch_size, size=SIZE, backend=backend, device="cpu", **kw)


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("mode", MODES)
def test_same_batches_as_the_local_folder(s3, folders, mode):
    backend, reader = mode
    remote = load("s3://imgs/train", backend, reader, seed=3)
    local = load(folders / "imgs" / "train", backend, seed=3)
    assert remote.classes == local.classes and len(remote) == len(local) == 9
    for epoch in (0, 1):
        remote.set_epoch(epoch), local.set_epoch(epoch)
        assert same(list(remote), list(local))
    gets = collections.Counter(p for m, p, _ in s3.requests() if m == "GET" and p.startswith("/imgs/train/"))
    assert len(gets) == 36 and set(gets.values()) <= {2, 3}  # each epoch every object once (+ DALI's look-ahead)
    if backend == "torch":
        assert set(gets.values()) == {2}
    assert "s3://imgs/train" in repr(remote)


@pytest.mark.slow
def test_resume_mid_epoch_from_a_bucket(s3, folders):
    remote = load("s3://imgs/train", seed=9)
    reference = list(load(folders / "imgs" / "train", seed=9))
    batches = iter(remote)
    head = [next(batches) for _ in range(4)]
    state = remote.state_dict()
    resumed = load("s3://imgs/train", seed=9)
    resumed.load_state_dict(state)
    assert same(head + list(resumed), reference)


@pytest.mark.slow
def test_torch_workers_fetch_in_their_own_processes(s3, folders):
    remote = load("s3://imgs/train", "torch", num_threads=2, seed=1)
    assert same(list(remote), list(load(folders / "imgs" / "train", "torch", num_threads=2, seed=1)))
    assert s3.object_gets() == 36


def test_listing_is_paginated(s3):
    loader = load("s3://imgs/train", storage=StoreOptions(list_page_size=5))
    assert len(loader.folder) == 36
    listings = [p for m, p, _ in s3.requests() if m == "GET" and p == "/imgs"]
    assert len(listings) == 8  # ceil(36 / 5) pages


@pytest.mark.slow
def test_endpoint_argument_instead_of_the_environment(s3, folders, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    remote = load("s3://imgs/train", train=False, endpoint_url=s3.endpoint)
    assert same(list(remote), list(load(folders / "imgs" / "train", train=False)))


def _rank_reads_its_shard(rank: int, world_size: int, local_root: str, cache_dir: str | None) -> dict:
    remote = load("s3://imgs/train", seed=5, cache_dir=cache_dir)
    local = load(local_root, seed=5)
    result = {"batches": len(remote), "equal": [], "names": []}
    for epoch in (0, 1):
        remote.set_epoch(epoch), local.set_epoch(epoch)
        result["equal"].append(same(list(remote), list(local)))
        result["names"].append([remote.folder.files[i] for b, _ in rank_batches(remote.spec, epoch) for i in b])
        torch.distributed.barrier()  # every shard of epoch 0 is in the cache before epoch 1 starts
    result["stats"] = remote.backend.source.stats.as_dict()
    return result


@pytest.mark.slow
def test_ranks_list_once_read_only_their_shard_and_share_a_cache(s3, folders, tmp_path):
    results = spawn(_rank_reads_its_shard, 3, str(folders / "imgs" / "train"), str(tmp_path), timeout=300)
    assert [r["batches"] for r in results] == [3, 3, 3]  # 36 images / 3 ranks / batch 4
    assert all(r["equal"] == [True, True] for r in results)
    for epoch in (0, 1):  # disjoint shards that cover the data set
        names = [n for r in results for n in r["names"][epoch]]
        assert len(names) == len(set(names)) == 36
    requests = s3.requests()
    assert sum(1 for m, p, _ in requests if m == "GET" and p == "/imgs") == 1  # one listing, on rank 0
    gets = [p for m, p, _ in requests if m == "GET" and p.startswith("/imgs/train/")]
    assert len(gets) == len(set(gets)) == 36  # epoch 0: each rank its shard; epoch 1: all from the shared cache
    assert sum(r["stats"]["cache_hits"] for r in results) == 36
    assert sum(r["stats"]["requests"] for r in results) == 36 + 1  # and the listing


def test_cache_hit_on_epoch_two(s3, folders, tmp_path):
    remote = load("s3://imgs/train", seed=2, cache_dir=tmp_path)
    first = list(remote)
    assert s3.object_gets() == 36
    s3.clear()
    second = list(remote)  # epoch 1, another shuffle
    assert s3.object_gets() == 0
    stats = remote.backend.source.stats.as_dict()
    assert stats["cache_hits"] == 36 and stats["cache_misses"] == 36
    local = load(folders / "imgs" / "train", seed=2)
    assert same(first, list(local)) and same(second, list(local))


@pytest.mark.slow
def test_cache_size_limit(s3, folders, tmp_path):
    total = sum(p.stat().st_size for p in (folders / "imgs" / "train").rglob("*.jpg"))
    remote = load("s3://imgs/train", seed=2, cache_dir=tmp_path, cache_max_bytes=total // 3)
    local = load(folders / "imgs" / "train", seed=2)
    for _ in range(2):
        assert same(list(remote), list(local))
        assert remote.backend.source.cache.size() <= total // 3
    assert 0 < s3.object_gets() < 72  # the second epoch found some objects in the cache, not all


@pytest.mark.slow
def test_changed_object_is_fetched_again_not_served_stale(s3, tmp_path):
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="mutable")
    for seed, name in ((7, "a"), (8, "b")):
        make_image_folder(tmp_path / name, classes=2, per_class=2, size=(40, 30), seed=seed)
    for path in sorted((tmp_path / "a").rglob("*.jpg")):
        client.put_object(
            Bucket="mutable", Key=f"train/{path.relative_to(tmp_path / 'a').as_posix()}", Body=path.read_bytes()
        )
    before = torch.cat([x for x, _ in load("s3://mutable/train", train=False, cache_dir=tmp_path / "c")])
    changed = (tmp_path / "b" / "00_red" / "00000.jpg").read_bytes()
    client.put_object(Bucket="mutable", Key="train/00_red/00000.jpg", Body=changed)  # a new ETag
    after = torch.cat([x for x, _ in load("s3://mutable/train", train=False, cache_dir=tmp_path / "c")])
    assert not torch.equal(before[0], after[0]) and torch.equal(before[1:], after[1:])
    assert s3.object_gets() == 4 + 1  # the unchanged three came from the cache


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_retries_when_the_server_restarts_mid_epoch(s3, folders, mode):
    backend, reader = mode
    # DALI's own reader does not outlast the restart: the loader rebuilds its pipeline at the failed batch,
    # which draws other random crops for the rest of the epoch, so that mode is compared without augmentation
    train = reader == "client"
    remote = load("s3://imgs/train", backend, reader, batch_size=2, seed=4, storage=PATIENT, train=train)
    local = list(load(folders / "imgs" / "train", backend, batch_size=2, seed=4, train=train))
    batches = iter(remote)
    got = [next(batches)]
    restart = s3.restart_in_background(down_s=2.0)  # the server process is killed now, started again in 2 s
    got += list(batches)
    restart.join()
    assert same(got, local)
    assert s3.object_gets() > 0  # the restarted server served the rest of the epoch
    if reader == "client":
        assert remote.backend.source.stats.retries > 0


@pytest.mark.parametrize("mode", MODES)
def test_retries_on_503_slowdown_and_dropped_connections(s3, folders, mode):
    backend, reader = mode
    s3.inject("503", 6, path_contains="/imgs/train/")
    s3.inject("drop", 3, path_contains="/imgs/train/")
    remote = load("s3://imgs/train", backend, reader, seed=6)
    assert same(list(remote), list(load(folders / "imgs" / "train", backend, seed=6)))
    statuses = [status for m, p, status in s3.requests() if p.startswith("/imgs/train/")]
    assert statuses.count("503") == 6
    if reader == "client":
        assert remote.backend.source.stats.retries == 9


@pytest.mark.parametrize("mode", MODES)
def test_gives_up_with_an_error_naming_bucket_and_key(s3, mode):
    backend, reader = mode
    s3.inject("503", 10_000, path_contains="/imgs/train/")
    remote = load("s3://imgs/train", backend, reader, storage=StoreOptions(retries=2, backoff_s=0.01))
    with pytest.raises(ObjectReadError, match=r"bucket 'imgs', key 'train/0\d_\w+/\d+\.jpg'.*3 attempts.*SlowDown"):
        list(remote)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DALI, reason="no DALI")
def test_dali_reader_refuses_what_it_cannot_do(s3, monkeypatch, tmp_path):
    list(load("s3://imgs/train", "dali", "dali"))  # DALI's S3 client now exists in this process, for this endpoint
    with pytest.raises(ValueError, match="cannot fill cache_dir"):
        load("s3://imgs/train", "dali", "dali", cache_dir=tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=f"already talks to {s3.endpoint} in this process"):
        load("s3://imgs/train", "dali", "dali", endpoint_url=s3.endpoint)


def test_missing_bucket(s3):
    with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket' does not exist at http://127.0.0.1"):
        load("s3://no-such-bucket/train")
    assert isinstance(BucketNotFoundError("x"), FileNotFoundError)


def test_empty_prefix_names_what_the_bucket_holds(s3):
    with pytest.raises(ValueError, match=r"no objects under s3://imgs/trian/.*misspelt.*holds: train/"):
        load("s3://imgs/trian")


def test_non_image_object_follows_the_strict_policy(s3):
    with pytest.raises(ValueError, match=r"not .* images: s3://mixed/train/00_red/notes.txt.*strict=False"):
        load("s3://mixed/train")
    with pytest.warns(UserWarning, match="notes.txt"):
        loader = load("s3://mixed/train", strict=False, on_corrupt="skip", train=False)
    assert len(loader.folder) == 6


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.filterwarnings("ignore:1 file.* are not .* images")  # notes.txt, skipped with strict=False
def test_undecodable_object_raises_or_is_skipped_by_name(s3, mode):
    backend, reader = mode
    bad = "s3://mixed/train/01_green/00001.jpg"
    with pytest.raises(CorruptImageError, match=bad):
        list(load("s3://mixed/train", backend, reader, strict=False, train=False))
    loader = load("s3://mixed/train", backend, reader, strict=False, train=False, on_corrupt="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images = torch.cat([x for x, _ in loader])
    assert images.shape[0] == 5 and loader.corrupt_files == [bad]
    assert any(bad in str(w.message) for w in caught)


def _rank_lists_a_missing_bucket(rank: int, world_size: int) -> str:
    try:
        load("s3://no-such-bucket/train")
    except BucketNotFoundError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_listing_error_reaches_every_rank(s3):
    messages = spawn(_rank_lists_a_missing_bucket, 2, timeout=300)
    assert all("does not exist" in m and "(listed on rank 0)" in m for m in messages)
    assert sum(1 for m, p, _ in s3.requests() if p == "/no-such-bucket") == 1


def test_other_fsspec_urls(folders):
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    for path in (folders / "imgs" / "train").rglob("*.jpg"):
        memory.pipe(f"/fastpar-test/train/{path.relative_to(folders / 'imgs' / 'train').as_posix()}", path.read_bytes())
    remote = load("memory://fastpar-test/train", seed=8)
    assert same(list(remote), list(load(folders / "imgs" / "train", seed=8)))
    with pytest.raises(ValueError, match="no objects under memory://fastpar-test/nothing/"):
        load("memory://fastpar-test/nothing")


@pytest.fixture(scope="module")
def auth_server(folders):
    with LocalS3({"imgs": folders / "imgs"}, auth=True) as s3:
        yield s3


@pytest.mark.slow
def test_permissions_and_credentials_are_reported_never_logged(auth_server, monkeypatch, folders):
    for key, value in auth_server.env("reader").items():
        monkeypatch.setenv(key, value)
    assert same(list(load("s3://imgs/train", train=False)), list(load(folders / "imgs" / "train", train=False)))
    for user in ("nobody", "lister"):
        for key, value in auth_server.env(user).items():
            monkeypatch.setenv(key, value)
        with pytest.raises(StoreAccessError) as caught:
            list(load("s3://imgs/train"))
        message = str(caught.value)
        assert "access denied" in message and "credentials from env" in message
        assert auth_server.users[user]["secret"] not in message and auth_server.users[user]["id"] not in message
        if user == "nobody":
            assert "listing s3://imgs/train/" in message and "s3:ListBucket" in message
        else:
            assert "reading s3://imgs/train/" in message and "s3:GetObject" in message
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreAccessError, match="rejected the credentials from env") as caught:
        load("s3://imgs/train")
    assert "not-the-secret" not in str(caught.value) and isinstance(caught.value, PermissionError)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.slow
def test_trainer_trains_from_a_bucket_with_a_shared_cache(s3, tmp_path):
    from fastpar.train import Trainer, TrainingOptions

    options = TrainingOptions(
        execution_environment="cpu",
        devices=2,
        max_epochs=2,
        batch_size=4,
        image_size=SIZE,
        validation_data="s3://imgs/train",
        data_cache_dir=str(tmp_path / "cache"),
        output_dir=str(tmp_path / "out"),
        progress_bar=False,
    )
    result = Trainer(
        make_model, make_optimizer, torch.nn.functional.cross_entropy, "s3://imgs/train", options=options
    ).fit()
    assert result.steps == 2 * 4 and result.last("val_accuracy") is not None
    gets = [p for m, p, _ in s3.requests() if m == "GET" and p.startswith("/imgs/train/")]
    assert len(gets) == len(set(gets)) == 36  # training and validation, both epochs: each object fetched once


def test_trainer_checks_the_url_before_launching(tmp_path):
    from fastpar.train import Trainer, TrainingOptions

    with pytest.raises(ValueError, match="not a valid S3 bucket name"):
        Trainer(
            make_model,
            make_optimizer,
            torch.nn.functional.cross_entropy,
            "s3://Bad_Bucket/x",
            options=TrainingOptions(output_dir=str(tmp_path)),
        ).fit()


@pytest.mark.slow
def test_bench_data_against_a_local_server(capsys, tmp_path):
    from fastpar.bench.cli import main

    json_path = tmp_path / "data.json"
    code = main(
        [
            "data",
            "--local-s3",
            "--count",
            "24",
            "--image-size",
            "64x48",
            "--size",
            "32",
            "--batch",
            "8",
            "--workers",
            "1",
            "--rounds",
            "1",
            "-n",
            "1",
            "-w",
            "0",
            "--json",
            str(json_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for row in ("local_torch", "s3_torch", "s3_cached_torch", "fetch_only"):
        assert row in out
    assert "goal: torch: s3 images/s >= 0.60x local_torch" in out
    assert "goal: torch: s3_cached images/s >= 0.95x local_torch" in out
    goals = json.loads(json_path.read_text())["summary"]["goals"]
    names = {g["name"] for g in goals}
    assert {"torch: s3 images/s >= 0.60x local_torch", "torch: s3_cached images/s >= 0.95x local_torch"} <= names
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
def test_bench_data_against_a_bucket_url(s3, capsys):
    from fastpar.bench.cli import main

    code = main(
        [
            "data",
            "--root",
            "s3://imgs/train",
            "--size",
            "32",
            "--batch",
            "8",
            "--workers",
            "1",
            "--rounds",
            "1",
            "-n",
            "1",
            "-w",
            "0",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "s3://imgs/train (36 images; local copy" in out and "s3_cached_torch" in out


@pytest.mark.slow
def test_local_server_leaves_no_temporary_folder(folders):
    with LocalS3({"imgs": folders / "imgs"}) as s3:
        workdir = s3.workdir
        assert (workdir / "server.log").exists()
        s3.restart()  # a restart keeps the folder: the server still writes there
        assert workdir.is_dir()
    assert not workdir.exists()
    unused = LocalS3({"imgs": folders / "imgs"})  # never started, never closed: goes with the object
    workdir = unused.workdir
    del unused
    import gc

    gc.collect()
    assert not workdir.exists()


def _bucket_with(name: str, keys: list[str], body: bytes) -> None:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    for key in keys:
        client.put_object(Bucket=name, Key=key, Body=body)


def test_a_key_with_an_empty_component_writes_nothing_outside_the_folder(s3, folders, tmp_path, capsys):
    from fastpar.bench.cli import main

    image = (folders / "imgs" / "train" / "00_red" / "00000.jpg").read_bytes()
    target = tmp_path / "x" / "owned.jpg"  # absolute: the key is "train//tmp/.../x/owned.jpg"
    _bucket_with("unsafe-empty", ["train/00_red/00000.jpg", f"train/{target}"], image)
    code = main(["data", "--root", "s3://unsafe-empty/train", "--size", "32", "--batch", "8", "--workers", "1"])
    out, err = capsys.readouterr()
    assert not target.parent.exists()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, out + err
    assert f"'train/{target}'" in lines[0] and "empty, '.' or '..' path component" in lines[0]


@pytest.mark.parametrize(
    ("bucket", "prefix", "key"),
    [
        ("unsafe-dotdot", "train", "train/../escape.jpg"),
        ("unsafe-dot", "train", "train/./00_red/00001.jpg"),
        ("unsafe-leading", "", "/abs/00001.jpg"),
    ],
)
def test_keys_that_name_no_path_below_the_folder_are_refused(s3, folders, bucket, prefix, key):
    image = (folders / "imgs" / "train" / "00_red" / "00000.jpg").read_bytes()
    _bucket_with(bucket, [f"{prefix}/00_red/00000.jpg".lstrip("/"), key], image)
    with pytest.raises(UnsafeObjectKeyError, match="path component") as caught:
        load(f"s3://{bucket}/{prefix}")
    assert repr(key) in str(caught.value)


def test_a_password_in_an_endpoint_url_never_reaches_a_message(s3, caplog):
    import logging
    import traceback

    from fastpar.data.remote.store import open_store
    from fastpar.launcher import free_port
    from fastpar.user_errors import describe

    endpoint = f"http://alice:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    keys_in_url = "s3://AKIAEXAMPLE:wJalr/K7s3cret@imgs/train"  # (in variables: a traceback quotes the source)

    def shown(exc: BaseException) -> str:  # every way an error reaches a person: message, one line, traceback
        return str(exc) + (describe(exc) or "") + "".join(traceback.format_exception(exc))

    with caplog.at_level(logging.DEBUG, logger="fastpar"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(StoreUnreachableError) as refused:
            load("s3://imgs/train", endpoint_url=endpoint)
        fast = StoreOptions(endpoint_url=endpoint, retries=1, backoff_s=0.01, max_backoff_s=0.01)
        store = open_store("s3://imgs/train", fast)
        store.reached = True  # a server that answered before: retried, then given up on
        with pytest.raises(ObjectReadError) as gave_up:
            store.list()
        with pytest.raises(ValueError) as in_url:
            load(keys_in_url)
    assert "connection refused at http://***@127.0.0.1:" in str(refused.value)
    assert "credentials" in str(in_url.value)
    seen = shown(refused.value) + shown(gave_up.value) + shown(in_url.value) + caplog.text
    seen += "".join(str(w.message) for w in warned)
    assert "s3cret" not in seen and "alice" not in seen and "AKIAEXAMPLE" not in seen


def test_bench_data_refuses_credentials_in_the_root_url_in_one_line(capsys):
    from fastpar.bench.cli import main

    code = main(["data", "--root", "s3://alice:s3cret@imgs/train"])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "s3cret" not in out + err, out + err
    assert "--root" in err and "credentials" in err
