"""Training a model that does not fit one device, standing on torch's engines: fully sharded parameters
through FSDP2 (``torch.distributed.fsdp.fully_shard``) with fastpar's wrapping, precision and meta-device
policies; pipeline stages through ``torch.distributed.pipelining`` with split points fastpar chooses; and
reshardable checkpoints of sharded state through ``torch.distributed.checkpoint``.

ZeRO-1/2 (sharding on fastpar's own DDP buckets) lives in :mod:`fastpar.zero`; the memory planner that
chooses between the strategies lives in :mod:`fastpar.costmodel`.
"""

__all__: list[str] = []
