"""The bucket caps fastpar's DDP (and ZeRO on its buckets) uses when the user gives no ``bucket_cap_mb``: one rule
for the runtime (``fastpar.ddp.buckets.default_caps``) and the memory planner.

CPU ranks, world size <= 2: ~4 MiB buckets. Measured on 2 ranks x 1 thread (``fastpar bench ddp`` models):
against torch's 25 MiB, more of the all-reduce runs during backward and at most ~4 MiB is left after it;
0.5-1 MiB buckets lose again to gloo's fixed cost per collective (~0.3 ms). Huge models keep at most
:data:`CPU_MAX_BUCKETS` buckets. At world size <= 2 the layout cannot change results (each element is one
a + b); above it the collective's summation order depends on the layout, so fastpar keeps torch's (a 1 MiB
first bucket, then 25 MiB), and with it torch's bits. Other devices: torch's.

Shared buckets (buckets in shared memory on the "fastpar" backend) with no core to spare beside each rank's
compute thread (``cores`` < 2 x ranks): torch's 25 MiB. A bucket's all-reduce then costs one pass over it plus
two waits for the other ranks; with every core computing, overlap only time-slices, so fewer buckets waste less.
"""

from __future__ import annotations

_MB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = _MB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
TORCH_BUCKET_BYTES = 25 * _MB  # torch's default bucket_cap_mb
CPU_BUCKET_BYTES = 4 * _MB
CPU_MAX_BUCKETS = 64

__all__ = ["CPU_BUCKET_BYTES", "CPU_MAX_BUCKETS", "DEFAULT_FIRST_BUCKET_BYTES", "TORCH_BUCKET_BYTES", "bucket_caps"]


def bucket_caps(
    total_bytes: int, device_type: str, world_size: int, *, shared_buckets: bool = False, cores: int | None = None
) -> list[int]:
    """Byte caps (the first bucket, then the rest) for ``total_bytes`` of gradients on ``device_type`` ranks;
    ``cores``: the CPUs the ranks share (default: this process's usable CPUs)."""
    if device_type != "cpu" or world_size > 2:
        return [DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES]
    if shared_buckets:
        from ..host import usable_cpu_count

        if (usable_cpu_count() if cores is None else cores) < 2 * world_size:
            return [DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES]
    return [DEFAULT_FIRST_BUCKET_BYTES, max(CPU_BUCKET_BYTES, -(-total_bytes // CPU_MAX_BUCKETS))]
