"""What real image folders and arrays contain, and how real training loops use a loader.

Regression tests for inputs found by probing the public API: image modes other than 8-bit RGB,
camera rotation in EXIF, macOS/Jupyter debris, symlink farms, worker errors, a pass abandoned with
``break``, and numpy arrays with odd strides, byte order or dtype.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from fastpar._optional import available
from fastpar.data import CorruptImageError, array_loader, image_loader, iterable_loader, scan_image_folder

Image = pytest.importorskip("PIL.Image")

BACKENDS = [
    "torch",
    pytest.param("dali", marks=pytest.mark.skipif(not available("nvidia.dali"), reason="DALI is not installed")),
]
SIZE = 16
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def load(root, backend, batch_size=4, **kw):
    kw.setdefault("num_threads", 0 if backend == "torch" else 1)
    return image_loader(root, batch_size, size=SIZE, backend=backend, device="cpu", **kw)


def unnormalize(images: torch.Tensor) -> torch.Tensor:
    return images * STD + MEAN  # back to 0..1 RGB


@pytest.fixture(scope="module")
def modes_folder(tmp_path_factory):
    """One file per mode real folders contain; class 'grey' holds mid-grey images only."""
    root = tmp_path_factory.mktemp("modes")
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    grey = Image.new("L", (40, 24), 128)
    (root / "colour").mkdir()
    (root / "grey").mkdir()
    rgb.convert("RGBA").save(root / "colour" / "rgba.png")
    rgb.convert("P").save(root / "colour" / "palette.png", transparency=0)
    rgb.convert("CMYK").save(root / "colour" / "cmyk.jpg")
    rgb.save(root / "colour" / "progressive.jpg", progressive=True)
    rgb.save(root / "colour" / "UPPER.JPG")
    rgb.save(root / "colour" / "Upper.PNG")
    grey.save(root / "grey" / "l.png")
    grey.convert("LA").save(root / "grey" / "la.png")
    grey.save(root / "grey" / "l.jpg")
    Image.fromarray(np.full((24, 40), 128 * 257, dtype=np.uint16)).save(root / "grey" / "sixteen_bit.png")
    return root


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_image_mode_gives_three_channel_float_batches(modes_folder, backend):
    ld = load(modes_folder, backend, batch_size=3, train=False, shuffle=False)
    seen = []
    for images, labels in ld:
        assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.isfinite(images).all()
        seen += list(zip(labels.tolist(), unnormalize(images), strict=True))
    assert sorted(label for label, _ in seen) == [0] * 6 + [1] * 4 and len(ld) == 4
    for label, image in seen:
        if label == 1:  # mid grey in every mode, 16-bit PNG included (PIL alone clips it to white)
            assert torch.allclose(image, torch.full_like(image, 128 / 255), atol=0.02)


@pytest.mark.parametrize("backend", BACKENDS)
def test_camera_rotation_in_exif_is_applied(tmp_path, backend):
    pixels = np.zeros((32, 64, 3), np.uint8)
    pixels[:, :32] = (255, 0, 0)  # left half red, right half blue
    pixels[:, 32:] = (0, 0, 255)
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display": the red half ends up on top
    (tmp_path / "a").mkdir()
    image.save(tmp_path / "a" / "phone.jpg", exif=exif.tobytes(), quality=95)
    (x, _), *_ = list(load(tmp_path, backend, batch_size=1, train=False))
    red = unnormalize(x)[0, 0]
    assert red[:4].mean() > 0.9 and red[-4:].mean() < 0.1


def test_hidden_debris_is_ignored_and_symlinked_folders_are_followed(tmp_path):
    jpeg = Image.new("RGB", (8, 8), (200, 10, 10))
    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        jpeg.save(tmp_path / "data" / cls / "0.jpg")
    a = tmp_path / "data" / "a"
    (a / "._0.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble resource fork")  # macOS copy debris
    (a / ".ipynb_checkpoints").mkdir()
    jpeg.save(a / ".ipynb_checkpoints" / "0-checkpoint.jpg")
    (a / ".DS_Store").write_bytes(b"\x00\x01")
    (tmp_path / "elsewhere").mkdir()
    jpeg.save(tmp_path / "elsewhere" / "1.jpg")
    os.symlink(tmp_path / "elsewhere", a / "linked")  # a link farm: samples live on other storage
    os.symlink(tmp_path / "data", a / "loop")  # a link back up the tree must not recurse forever
    os.symlink(tmp_path / "gone.jpg", a / "dangling.jpg")
    folder = scan_image_folder(tmp_path / "data")
    names = [os.path.relpath(f, tmp_path / "data") for f in folder.files]
    assert names[:2] == ["a/0.jpg", "a/linked/1.jpg"] and names[-1] == "b/0.jpg" and folder.labels[-1] == 1
    assert not any("/." in n or "checkpoint" in n for n in names)
    assert sum(len(y) for _, y in load(tmp_path / "data", "torch")) == len(names)


def test_corrupt_image_in_a_worker_is_raised_plainly(tmp_path):
    (tmp_path / "a").mkdir()
    for k in range(4):
        Image.new("RGB", (8, 8)).save(tmp_path / "a" / f"{k}.jpg")
    (tmp_path / "a" / "2.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    with pytest.raises(CorruptImageError) as info:
        list(load(tmp_path, "torch", num_threads=2))
    message = str(info.value)
    assert message.startswith(f"cannot decode image {tmp_path / 'a' / '2.jpg'}") and "on_corrupt='skip'" in message
    assert "DataLoader worker" not in message


def _children() -> set[int]:
    """Live child processes of this process (earlier tests may leave e.g. multiprocessing's resource tracker)."""
    me = str(os.getpid())
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[1] == me and stat[0] != "Z":
            pids.add(int(pid))
    return pids


def _new_children(before: set[int], wait_s: float = 5.0) -> set[int]:
    """Children started since ``before`` that are still alive after up to ``wait_s`` (workers exit asynchronously)."""
    deadline = time.monotonic() + wait_s
    while (new := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


@pytest.mark.parametrize(("backend", "workers"), [("torch", 2), pytest.param("dali", 2, marks=BACKENDS[1].marks)])
def test_a_pass_abandoned_with_break_leaks_nothing_and_the_next_pass_is_whole(modes_folder, backend, workers):
    before = _children()
    ld = load(modes_folder, backend, batch_size=2, num_threads=workers)
    full = [y.tolist() for _, y in ld]  # epoch 0
    ld.set_epoch(0)
    for _ in range(2):
        for k, _batch in enumerate(ld):
            if k == 1:
                break
        assert ld.state_dict()["batch"] == 2  # a checkpoint taken now resumes after the two batches
    assert _new_children(before) == set()  # the DataLoader's workers are gone
    assert [y.tolist() for _, y in ld] == full  # a new pass: the whole epoch again, like a DataLoader
    assert len(full) == len(ld) and ld.state_dict()["epoch"] == 1


def test_stream_pass_after_break_starts_over():
    ld = iterable_loader(lambda epoch: range(10), 3, device="cpu")
    for _ in ld:
        break
    assert [b.tolist() for b in ld] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(20).reshape(10, 2)[::-1],  # negative strides (a flipped view)
        lambda: np.arange(20, dtype=">i8").reshape(10, 2),  # big-endian, as some .npy/.mat files are
        lambda: np.asfortranarray(np.arange(20).reshape(10, 2)),
        lambda: np.arange(30).reshape(10, 3)[:, ::2],
        lambda: torch.arange(30).reshape(10, 3)[:, ::2],
        lambda: np.arange(20, dtype=np.uint16).reshape(10, 2),  # torch cannot index_select uint16
    ],
)
def test_array_loader_takes_any_layout(make):
    x = make()
    y = np.arange(10)[::-1]
    batches = list(array_loader(x, y, 4, shuffle=False, device="cpu"))
    assert [len(yb) for _, yb in batches] == [4, 4, 2]
    got = torch.cat([xb for xb, _ in batches]).to(torch.int64)
    assert got.tolist() == np.asarray(x).astype(np.int64).tolist()
    assert torch.cat([yb for _, yb in batches]).tolist() == list(range(9, -1, -1))


def test_array_loader_rejects_object_arrays_up_front():
    with pytest.raises(ValueError, match="x has dtype object.*iterable_loader"):
        array_loader(np.array([{"a": 1}] * 4, dtype=object), None, 2)
