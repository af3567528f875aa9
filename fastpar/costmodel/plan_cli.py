"""``fastpar plan``: which training strategy fits a model on N devices, and which is fastest.

::

    fastpar plan --transformer layers=24,hidden=2048,vocab=50000 --seq-len 1024 --devices 8 --device-memory 80GB
    fastpar plan --model torchvision.models:resnet50 --input-shape 3,224,224 --devices 4 --nvml --batch-size 64

Prints per-device parameters, gradients, optimizer state, activations, buffers in flight and the total for
DDP, ZeRO-1, ZeRO-2, FSDP2 (resharding after forward or not) and pipeline stages, whether each fits, the
step time the cost model predicts, and the pick (or what would make something fit).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..user_errors import UserError
from .pipeline_split import SCHEDULES

_TRANSFORMER_KEYS = ("layers", "hidden", "vocab", "heads", "seq_len", "ffn_mult")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastpar plan", description=__doc__.split("\n\n")[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="an importable constructor, package.module:function")
    model.add_argument(
        "--transformer", help="the reference transformer: layers=..,hidden=..,vocab=..[,heads=..,ffn_mult=..]"
    )
    p.add_argument("--kwargs", default=None, help="--model's keyword arguments as a JSON object")
    p.add_argument(
        "--input-shape",
        default=None,
        help="one sample's input to --model, without the batch dimension (e.g. 3,224,224): any nn.Module can be "
        "planned; without it the module needs an example_batch method",
    )
    p.add_argument(
        "--input-dtype", default="float32", help="dtype of --input-shape's input: float32, bfloat16, int64, ..."
    )
    p.add_argument("--devices", type=int, required=True, help="devices (ranks) to train on")
    memory = p.add_mutually_exclusive_group(required=True)
    memory.add_argument("--device-memory", help="memory per device: 80GB, 80GiB, 512MiB or bytes")
    memory.add_argument("--nvml", action="store_true", help="the smallest GPU's memory, as NVML reports it")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="parameter dtype")
    p.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16", "fp16"), help="gradient reduction dtype")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "sgd-momentum"))
    p.add_argument("--batch-size", type=int, default=8, help="samples per device per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (sequence models)")
    p.add_argument("--strategies", default=None, help="comma-separated subset of ddp,zero1,zero2,fsdp,pipeline")
    p.add_argument("--stages", default=None, help="pipeline stage counts to consider, e.g. 2,4")
    p.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="pipeline schedules to consider (default: %(default)s)"
    )
    p.add_argument("--microbatches", default=None, help="pipeline microbatch counts to consider, e.g. 4,8")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what the ranks train on")
    p.add_argument("--device-flops", type=float, default=None, help="FLOP/s per device (compute as a FLOP count)")
    p.add_argument("--profile", default=None, help="a 'fastpar bench calibrate' profile pricing the collectives")
    p.add_argument(
        "--fabric", default=None, help="a fabric preset pricing the collectives (see fastpar bench simulate)"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "fastpar"),
        help="CPU ranks' backend, priced with the profile shipped for it when neither --profile nor --fabric is "
        "given (auto: fastpar's shared-memory backend when built, as the Trainer picks; default auto)",
    )
    p.add_argument("--headroom", type=float, default=0.10, help="share of device memory kept free (default 0.10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None


def transformer_kwargs(text: str) -> dict[str, int]:
    """``"layers=4,hidden=256,vocab=1000"`` -> keyword arguments of the reference transformer."""
    kwargs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _TRANSFORMER_KEYS:
            raise UserError(f"--transformer takes {'=..,'.join(_TRANSFORMER_KEYS)}=..; cannot read {item!r}")
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise UserError(f"--transformer {key} must be an integer, got {value!r}") from None
    missing = [k for k in ("layers", "hidden", "vocab") if k not in kwargs]
    if missing:
        raise UserError(f"--transformer needs {', '.join(missing)} (e.g. layers=12,hidden=768,vocab=50257)")
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..comm import cpu_backend  # imports torch: after --help
    from .memory_planner import STRATEGIES, plan
    from .model_spec import ModelSpec

    if args.transformer is not None:
        if args.input_shape is not None:
            raise UserError("--input-shape is for --model; --transformer makes its own token batches")
        kwargs = transformer_kwargs(args.transformer)
        if args.seq_len is not None:
            kwargs.setdefault("seq_len", args.seq_len)
        spec = ModelSpec.transformer(**kwargs)
    else:
        spec = ModelSpec.from_path(
            args.model,
            args.kwargs,
            seq_len=args.seq_len,
            input_shape=None if args.input_shape is None else _ints(args.input_shape, "--input-shape"),
            input_dtype=args.input_dtype,
        )
    strategies = STRATEGIES if args.strategies is None else [s.strip() for s in args.strategies.split(",") if s.strip()]
    try:
        result = plan(
            spec,
            devices=args.devices,
            device_memory=None if args.nvml else args.device_memory,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            param_dtype=args.dtype,
            reduce_dtype=args.reduce_dtype,
            optimizer=args.optimizer,
            strategies=strategies,
            stages=_ints(args.stages, "--stages"),
            schedules=[s.strip() for s in args.schedules.split(",") if s.strip()],
            microbatches=_ints(args.microbatches, "--microbatches"),
            device=args.device,
            profile=args.profile,
            fabric=args.fabric,
            backend=cpu_backend(args.backend),
            headroom=args.headroom,
            device_flops=args.device_flops,
        )
    except ValueError as exc:  # an option the planner refuses (stages that don't divide the devices, ...)
        raise UserError(str(exc)) from None
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        print()
    else:
        print(result.table())
    return 0 if result.choice else 1
