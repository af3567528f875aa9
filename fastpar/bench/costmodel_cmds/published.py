"""Published multi-GPU scaling measurements, rebuilt from their sources' own inputs (``--profile published:NAME``).

Each case takes, from its source: the single-GPU training throughput (-> compute time of one step), the
model (-> gradient tensors, from the architecture), the GPUs and network (-> a fabric), how gradients were
reduced (-> bucketing), and the measured scaling efficiency to check the prediction against. What the
sources do not give is assumed the same way for every case and listed with it:

- backward is 2/3 of a step's compute (forward 1/3; the optimizer folded in), and each layer's
  gradient is ready when backward has done that layer's share of the FLOPs (last layer first);
- bus bandwidth = link peak x 0.8 (``fastpar.costmodel.fabrics.LINK_EFFICIENCY``), NCCL's per-step latencies;
- no slowdown of compute by communication kernels (NCCL's use of SMs is not modelled).

Sources:
[tf]  TensorFlow "Benchmarks" guide (tensorflow/docs, site/en/r1/guide/performance/benchmarks.md, May 2017):
      tf_cnn_benchmarks on an NVIDIA DGX-1 (8x Tesla P100), batch 64 per GPU, synthetic data; VGG16 with
      variable_update=replicated (with NCCL): 154 / 295 / 584 / 1081 images/s on 1 / 2 / 4 / 8 GPUs;
      InceptionV3 142 images/s on 1 GPU.
[hvd] Horovod docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s network,
      tf_cnn_benchmarks --batch_size 64: "90% scaling efficiency for both Inception V3 and ResNet-101, and
      68% scaling efficiency for VGG-16" (512 GPUs). docs/tensor-fusion.rst: fusion buffer 64 MB, tensors
      copied in and out of it. The single-GPU rates are [tf]'s P100 numbers (the same benchmark script).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...costmodel.collective_costs import Fabric, Link
from ...costmodel.fabrics import LATENCY_US, LINK_EFFICIENCY, NCCL_BASE_LATENCY_US, preset
from ...costmodel.step_simulator import GradArrival, StepTimeline, SyncCosts

BACKWARD_SHARE = 2 / 3
P100_COPY_GBS = 732 / 2 * LINK_EFFICIENCY  # HBM2 peak 732 GB/s, read + write: gradient bytes copied per second


def _conv(cin: int, cout: int, size: int, k: int = 3) -> tuple[int, int, float]:
    """(weight elements, bias elements, forward FLOPs per image) of a k x k convolution at size x size output."""
    return k * k * cin * cout, cout, 2.0 * k * k * cin * cout * size * size


def _fc(cin: int, cout: int) -> tuple[int, int, float]:
    return cin * cout, cout, 2.0 * cin * cout


def vgg16_layers() -> list[tuple[int, int, float]]:
    """VGG16 (Simonyan & Zisserman, configuration D) at 224x224, 1000 classes: 138,357,544 parameters."""
    plan = [
        (3, 64, 224),
        (64, 64, 224),
        (64, 128, 112),
        (128, 128, 112),
        (128, 256, 56),
        (256, 256, 56),
        (256, 256, 56),
        (256, 512, 28),
        (512, 512, 28),
        (512, 512, 28),
        (512, 512, 14),
        (512, 512, 14),
        (512, 512, 14),
    ]
    return [_conv(*p) for p in plan] + [_fc(512 * 7 * 7, 4096), _fc(4096, 4096), _fc(4096, 1000)]


def inception3_layers() -> list[tuple[int, int, float]]:
    """Inception V3 (Szegedy et al. 2016): 23.8M parameters. Its ~95 convolutions are not listed here: the
    2048 x 1000 classifier comes first in backward, the other 21.8M parameters arrive evenly over backward
    (20 equal tensors of equal FLOPs) -- an assumption, not the architecture."""
    rest = (23_851_784 - 2048 * 1000 - 1000) // 20
    return [(rest, 0, 1.0) for _ in range(20)] + [(2048 * 1000, 1000, 0.0)]


def timeline_from_layers(
    layers: list[tuple[int, int, float]], step_s: float, bytes_per_element: int = 4
) -> StepTimeline:
    """Gradients of ``layers`` (input to output) ready as backward does each layer's FLOPs, last layer first."""
    backward = BACKWARD_SHARE * step_s
    total_flops = sum(f for _, _, f in layers)
    grads, done, index = [], 0.0, 0
    for weights, bias, flops in reversed(layers):
        done += flops
        ready = backward * done / total_flops
        for elements in (weights, bias):
            if elements:
                grads.append(GradArrival(index, elements * bytes_per_element, "float32", ready))
                index += 1
    return StepTimeline(grads, backward_s=backward, forward_s=step_s - backward)


def _dgx1_p100(ranks: int) -> Fabric:
    """DGX-1 (P100): NVLink 1 (20 GB/s per link per direction) in a hybrid cube-mesh. A ring over 2 GPUs
    has one link, 4 GPUs (a fully linked quad) one Hamiltonian cycle, 8 GPUs two edge-disjoint ones; each
    cycle runs in both directions, so the bus bandwidth is 20 GB/s x 1, 2 or 4 (peak)."""
    lanes = {1: 1, 2: 1, 4: 2, 8: 4}[ranks]
    return Fabric(
        "DGX-1 P100 NVLink",
        8,
        Link(20.0 * lanes * LINK_EFFICIENCY, LATENCY_US["nvlink"]),
        base_latency_us=NCCL_BASE_LATENCY_US,
        tree=False,
    )


def _horovod_fabric(ranks: int) -> Fabric:
    # NCCL 2 of 2017 had rings only (trees came with NCCL 2.4)
    from dataclasses import replace

    return replace(preset("p100-pcie-25gbe"), tree=False)


@dataclass(frozen=True)
class PublishedCase:
    title: str
    source: str
    layers: Callable[[], list[tuple[int, int, float]]]
    step_s: float  # one GPU's step: batch / images per second
    fabric: Callable[[int], Fabric]
    caps_bytes: tuple[int, ...] | None  # None: one collective per gradient tensor
    fit: bool  # Horovod Tensor Fusion (True) or torch-style closing at the cap (False)
    costs: SyncCosts
    efficiency: dict[int, float]  # ranks -> published scaling efficiency

    def timeline(self) -> StepTimeline:
        return timeline_from_layers(self.layers(), self.step_s)


def _horovod_512(model: str, layers, images_per_s: float, efficiency: float) -> PublishedCase:
    """Horovod's 512-GPU benchmark: 64 MB Tensor Fusion, tensors copied in and out at P100 memcpy speed."""
    copy = 1 / (P100_COPY_GBS * 1e9)
    return PublishedCase(
        title=f"{model}, Horovod + tf_cnn_benchmarks, 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64/GPU",
        source=f"[hvd] Horovod docs/benchmarks.rst: {efficiency:.0%} scaling efficiency on 512 GPUs; "
        f"1-GPU rate {images_per_s:g} images/s [tf]",
        layers=layers,
        step_s=64 / images_per_s,
        fabric=_horovod_fabric,
        caps_bytes=(64 << 20,),
        fit=True,
        costs=SyncCosts(pack_s_per_byte=copy, unpack_s_per_byte=copy),
        efficiency={512: efficiency},
    )


CASES: dict[str, PublishedCase] = {
    "tf-dgx1-vgg16": PublishedCase(
        title="VGG16, tf_cnn_benchmarks replicated + NCCL, DGX-1 (8x P100 NVLink), batch 64/GPU",
        source="[tf] TensorFlow Benchmarks guide, DGX-1 P100 synthetic: 154/295/584/1081 images/s on 1/2/4/8 GPUs",
        layers=vgg16_layers,
        step_s=64 / 154,
        fabric=_dgx1_p100,
        caps_bytes=None,
        fit=False,
        costs=SyncCosts(),
        efficiency={2: 295 / (2 * 154), 4: 584 / (4 * 154), 8: 1081 / (8 * 154)},
    ),
    "horovod-vgg16": _horovod_512("VGG-16", vgg16_layers, 154, 0.68),
    "horovod-inception3": _horovod_512("Inception V3", inception3_layers, 142, 0.90),
}


def case(name: str) -> PublishedCase:
    try:
        return CASES[name]
    except KeyError:
        raise ValueError(f"unknown published case {name!r}; choose one of {', '.join(CASES)}") from None
