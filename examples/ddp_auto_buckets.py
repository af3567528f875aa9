"""fastpar DDP choosing its own buckets (bucket_cap_mb="auto") on 2 CPU processes: python examples/ddp_auto_buckets.py"""

import torch
from torch import nn

import fastpar
from fastpar.launcher import spawn


def train(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])
    model = fastpar.DDP(model, bucket_cap_mb="auto")  # measures the first steps, then picks the buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return model.comm_stats()


if __name__ == "__main__":
    stats = spawn(train, 2)[0]  # rank 0's view; every rank decided the same
    auto = stats["auto"]
    print(
        f"bucket_cap_mb='auto': {auto['phase']}; chose {auto['chosen']}, kept {auto['kept']}, {auto['buckets']} buckets"
    )
    print("predicted sync per step (ms):", {k: round(v, 1) for k, v in auto["predicted_ms"].items()})
    print(
        f"last step: {stats['collectives']} collectives, {stats['finished_early']} bucket(s) finished during backward"
    )
