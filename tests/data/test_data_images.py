"""image_loader on both backends (DALI runs on CPU here): shapes, labels, plan, resume, bad input."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

from fastpar._optional import available
from fastpar.data import CorruptImageError, image_loader, make_image_folder, rank_batches, scan_image_folder
from fastpar.data.synthetic import class_colours

BACKENDS = [
    "torch",
    pytest.param("dali", marks=pytest.mark.skipif(not available("nvidia.dali"), reason="DALI is not installed")),
]
SIZE = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("imgs"), classes=4, per_class=11, size=(64, 48), seed=0)


def load(root, backend, batch_size=8, **kw):
    kw.setdefault("num_threads", 0 if backend == "torch" else 1)
    return image_loader(root, batch_size, size=SIZE, backend=backend, device="cpu", **kw)


def colour_labels(images: torch.Tensor) -> list[int]:
    """The class whose colour is nearest (in chroma) to each image's mean colour."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1)
    rgb = (images.flatten(2).mean(2).T * std + mean).T  # (B, 3) in 0..1
    chroma = rgb - rgb.mean(1, keepdim=True)
    palette = torch.tensor([c for _, c in class_colours(4)], dtype=torch.float32)
    palette = palette - palette.mean(1, keepdim=True)
    return torch.nn.functional.cosine_similarity(chroma[:, None], palette[None], dim=2).argmax(1).tolist()


def test_synthetic_folder_is_deterministic(tmp_path):
    a = make_image_folder(tmp_path / "a", classes=3, per_class=2, seed=4)
    b = make_image_folder(tmp_path / "b", classes=3, per_class=2, seed=4)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files_a) == 6 and files_a == sorted(p.relative_to(b) for p in b.rglob("*.jpg"))
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files_a)
    assert scan_image_folder(a).classes == ["00_red", "01_green", "02_blue"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_dtypes_and_labels_match_the_colours(folder, backend):
    ld = load(folder, backend, train=False)
    labels, batches = [], 0
    for images, y in ld:
        assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == torch.float32 and y.dtype == torch.int64
        assert images.shape[0] == y.shape[0] and images.device.type == "cpu"
        assert colour_labels(images) == y.tolist()
        labels += y.tolist()
        batches += 1
    assert batches == len(ld) == 6 and labels == sorted(labels) == scan_image_folder(folder).labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_batches_are_augmented_and_deterministic(folder, backend):
    first = [(x.clone(), y) for x, y in load(folder, backend, seed=3)]
    again = [(x.clone(), y) for x, y in load(folder, backend, seed=3)]
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    labels = torch.cat([y for _, y in first])
    assert labels.tolist() != sorted(labels.tolist())  # shuffled
    assert all(colour_labels(x) == y.tolist() for x, y in first)  # crops keep the class colour
    eval_images = torch.cat([x for x, _ in load(folder, backend, train=False)])
    assert not torch.allclose(torch.cat([x for x, _ in first]).sort(0).values, eval_images.sort(0).values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_epoch_reshuffles_and_cursor_advances(folder, backend):
    ld = load(folder, backend)
    epoch0 = torch.cat([y for _, y in ld])
    assert ld.state_dict()["epoch"] == 1
    ld.set_epoch(0)
    assert torch.equal(torch.cat([y for _, y in ld]), epoch0)
    ld.set_epoch(5)
    epoch5 = torch.cat([y for _, y in ld])
    assert sorted(epoch5.tolist()) == sorted(epoch0.tolist()) and not torch.equal(epoch5, epoch0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["partial", "drop", "pad"])
def test_ranks_get_equal_batch_counts(folder, backend, policy):
    # 44 images, 3 ranks, batch 5: not divisible by the batch or the world size
    loaders = [load(folder, backend, batch_size=5, rank=r, world_size=3, last_batch=policy) for r in range(3)]
    sizes = [[len(y) for _, y in ld] for ld in loaders]
    assert len({len(s) for s in sizes}) == 1 and len(sizes[0]) == len(loaders[0])
    total = sum(map(sum, sizes))
    assert total == {"partial": 44, "drop": 30, "pad": 45}[policy]


def test_both_backends_follow_the_same_plan(folder):
    if not available("nvidia.dali"):
        pytest.skip("DALI is not installed")
    for train in (True, False):
        by_backend = {}
        for backend in ("torch", "dali"):
            batches = list(load(folder, backend, batch_size=6, train=train, rank=1, world_size=2, seed=9))
            by_backend[backend] = batches
            assert {x.shape[1:] for x, _ in batches} == {(3, SIZE, SIZE)}
        t, d = by_backend["torch"], by_backend["dali"]
        assert [y.tolist() for _, y in t] == [y.tolist() for _, y in d]
        assert [x.shape for x, _ in t] == [x.shape for x, _ in d]
    # eval crops are the same region: the resamplers differ pixel by pixel, the mean colours agree
    colour = [torch.cat([x for x, _ in batches]).mean((2, 3)) for batches in (t, d)]
    assert torch.allclose(colour[0], colour[1], atol=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_matches_and_skips_without_decoding(folder, tmp_path, backend):
    root = shutil.copytree(folder, tmp_path / "copy")
    full = [(x.clone(), y) for x, y in load(root, backend, train=False, shuffle=True, seed=2)]
    ld = load(root, backend, train=False, shuffle=True, seed=2)
    it = iter(ld)
    for _ in range(2):
        next(it)
    state = ld.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 2)
    # garble the files of the two batches already done: a resumed loader must not touch them
    files = scan_image_folder(root).files
    for indices, _ in rank_batches(ld.spec, 0)[:2]:
        for i in indices:
            open(files[i], "wb").write(b"garbage")
    resumed = load(root, backend, train=False, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - 2
    for (xa, ya), (xb, yb) in zip(full[2:], rest, strict=True):
        assert torch.equal(ya, yb) and torch.allclose(xa, xb)


def test_torch_resume_repeats_training_augmentation(folder):
    full = [x.clone() for x, _ in load(folder, "torch", seed=7)]
    ld = load(folder, "torch", seed=7)
    ld.load_state_dict({"epoch": 0, "batch": 3})
    assert all(torch.equal(a, b) for a, b in zip(full[3:], (x for x, _ in ld), strict=True))


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_loader(tmp_path / "missing", 4, backend="torch")
    with pytest.raises(ValueError, match="no class subfolders.*empty"):
        image_loader(tmp_path, 4, backend="torch")
    (tmp_path / "a.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="no class subfolders.*1 image file"):
        image_loader(tmp_path, 4, backend="torch")
    (tmp_path / "cat").mkdir()
    with pytest.raises(ValueError, match="no .*images in them"):
        image_loader(tmp_path, 4, backend="torch")
    make_image_folder(tmp_path / "ok", classes=2, per_class=2)
    (tmp_path / "ok" / "00_red" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt"):
        image_loader(tmp_path / "ok", 4, backend="torch")
    with pytest.warns(UserWarning, match="notes.txt"):
        assert len(scan_image_folder(tmp_path / "ok", strict=False)) == 4
    with pytest.raises(ValueError, match="backend"):
        image_loader(tmp_path / "ok", 4, backend="opencv", strict=False)
    with pytest.raises(ValueError, match="on_corrupt"):
        image_loader(tmp_path / "ok", 4, on_corrupt="ignore", strict=False)


@pytest.fixture
def corrupt_folder(tmp_path):
    root = make_image_folder(tmp_path / "c", classes=2, per_class=6, size=(64, 48))
    bad = root / "01_green" / "00002.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    return root, str(bad)


@pytest.mark.parametrize(
    ("backend", "workers"), [("torch", 0), ("torch", 2), pytest.param("dali", 2, marks=BACKENDS[1].marks)]
)
def test_corrupt_image_raises_with_its_path(corrupt_folder, backend, workers):
    root, bad = corrupt_folder
    with pytest.raises(CorruptImageError, match="00002.jpg"):
        list(load(root, backend, batch_size=4, num_threads=workers))


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_image_skipped_counted_and_warned_once(corrupt_folder, backend):
    root, bad = corrupt_folder
    ld = load(root, backend, batch_size=4, on_corrupt="skip", train=False)
    with pytest.warns(UserWarning, match="skipped 1 undecodable") as record:
        sizes = [len(y) for _, y in ld]
    assert [str(w.message) for w in record if "undecodable" in str(w.message)][0].count(bad) == 1
    assert len(sizes) == len(ld) == 3 and sum(sizes) == 11 and ld.corrupt_files == [bad]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same file
        assert sum(len(y) for _, y in ld) == 11


def test_dali_bare_pipeline_runs(folder):
    if not available("nvidia.dali"):
        pytest.skip("DALI is not installed")
    from fastpar.data.dali_backend import bare_pipeline

    f = scan_image_folder(folder)
    pipe = bare_pipeline(f.files, f.labels, 8, 1, size=SIZE)
    images, labels = pipe.run()
    assert np.asarray(images.as_tensor()).shape == (8, 3, SIZE, SIZE)
    assert np.asarray(labels.as_tensor()).reshape(-1).dtype == np.int32


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_output_on_the_current_device(folder, backend):
    for train in (True, False):
        x, y = next(iter(image_loader(folder, 8, train=train, size=SIZE, backend=backend, num_threads=1)))
        assert x.device == y.device == torch.device("cuda", torch.cuda.current_device())
        assert x.shape == (8, 3, SIZE, SIZE) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert colour_labels(x.cpu()) == y.cpu().tolist()


@pytest.mark.skipif(not available("nvidia.dali"), reason="DALI is not installed")
def test_dali_next_epoch_started_ahead_matches_a_fresh_pass(folder):
    """The pipeline started during epoch 0's last batch serves epoch 1 exactly as a fresh pass would;
    a pass other than the expected one drops it and rebuilds."""
    ld = load(folder, "dali", seed=3)
    for _ in ld:
        pass
    ahead = [x.clone() for x, _ in ld]  # epoch 1, from the pipeline started during epoch 0
    fresh = load(folder, "dali", seed=3)
    fresh.set_epoch(1)
    assert all(torch.equal(a, b) for a, (b, _) in zip(ahead, fresh, strict=True))
    ld.set_epoch(0)
    assert len(list(ld)) == len(ld)


def test_gpu_decoding_says_what_it_needs(folder, monkeypatch):
    """``device="mixed"`` (DALI's GPU decoder) is a device image_loader understands, never torch.device's error."""
    from fastpar.data import loader as loader_module

    with pytest.raises(ValueError, match='device="mixed" decodes on the GPU with DALI; the torch backend'):
        image_loader(folder, 8, backend="torch", device="mixed")
    monkeypatch.setattr(loader_module, "available", lambda name: False)
    with pytest.raises(ValueError, match=r"DALI, which is not installed: pip install .*\[dali\]"):
        image_loader(folder, 8, device="mixed")
    monkeypatch.setattr(loader_module, "available", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("auto", "dali"):
        with pytest.raises(ValueError, match='device="mixed" decodes on a GPU, but torch sees none here'):
            image_loader(folder, 8, backend=backend, device="mixed")


@pytest.mark.cuda
@pytest.mark.skipif(not available("nvidia.dali"), reason="DALI is not installed")
def test_gpu_decoding_delivers_on_the_current_gpu(folder):
    loader = image_loader(folder, 8, size=SIZE, device="mixed", num_threads=1)
    x, y = next(iter(loader))
    assert x.device == y.device == torch.device("cuda", torch.cuda.current_device())
    assert colour_labels(x.cpu()) == y.cpu().tolist()
